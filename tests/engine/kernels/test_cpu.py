"""pdserve's compiled CPU kernels: building and caching the library, the GEMV, RMSNorm
and SwiGLU against torch's, the argument checks, and what happens where they cannot be
built or are switched off (the paged decode attention: tests/engine/attention/test_torch_attention.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import GEMV_MAX_ROWS, NativeKernels
from engine.kernels.cpu.build import SOURCES, build, library_path, source_files

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("out_features,in_features", [(768, 512), (33, 17), (5, 3), (4, 1)])
def test_gemv_is_the_linear(kernels: NativeKernels, rows: int, out_features: int,
                            in_features: int) -> None:
    """Every output row (the ones past the last group of 4 too), with and without bias,
    for 2-d and 3-d inputs."""
    torch.manual_seed(rows * out_features)
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    b = torch.randn(out_features)
    torch.testing.assert_close(kernels.gemv(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.gemv(x[None], w), (x @ w.T)[None], rtol=1e-5, atol=1e-4)


def test_gemv_refuses_what_it_does_not_take(kernels: NativeKernels) -> None:
    w = torch.randn(8, 16)
    for x in (torch.randn(GEMV_MAX_ROWS + 1, 16),  # a batch oneDNN should take
              torch.randn(16, 2).T,  # not contiguous
              torch.randn(1, 16, dtype=torch.float64),
              torch.randn(1, 15)):  # inner sizes differ
        assert not kernels.supports_gemv(x, w)
        with pytest.raises(ValueError, match="gemv takes"):
            kernels.gemv(x, w)
    with pytest.raises(ValueError, match="bias"):
        kernels.gemv(torch.randn(1, 16), w, torch.randn(7))
    # empty shapes are not for the GEMV; the onednn_gemv kernel multiplies them with oneDNN
    assert kernels.gemv_checked_weight(torch.randn(1, 0), torch.randn(8, 0), None) is None
    assert kernels.gemv_checked_weight(torch.randn(1, 16), torch.randn(0, 16), None) is None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", [(768, 512), (100, 1408), (33, 129), (5, 3),
                                                      (1, 1)])
def test_packed_gemm_is_the_linear(kernels: NativeKernels, out_features: int, in_features: int,
                                   threads: int) -> None:
    """Rows in one block and across blocks and row tiles (14 and 256 on AVX-512), output
    features past the last full panel, K past the last full chunk (128), with and without
    bias, 2-d and 3-d; against float64."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(out_features + in_features)
        w, b = torch.randn(out_features, in_features), torch.randn(out_features)
        panels = kernels.pack_panels(w)
        assert panels.numel() == kernels.panel_floats(out_features, in_features)
        for rows in (1, 4, 14, 15, 29, 32, 64, 257):
            x = torch.randn(rows, in_features)
            want = x.double() @ w.double().T
            torch.testing.assert_close(kernels.gemm_packed(x, panels, out_features, b).double(),
                                       want + b.double(), rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(kernels.gemm_packed(x[None], panels, out_features).double(),
                                       want[None], rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_packed_gemm_refuses_what_it_does_not_take(kernels: NativeKernels) -> None:
    w = torch.randn(40, 16)
    panels = kernels.pack_panels(w)
    for x in (torch.randn(4, 15), torch.randn(4, 16, dtype=torch.float64), torch.randn(0, 16)):
        with pytest.raises(ValueError, match="gemm_packed takes"):
            kernels.gemm_packed(x, panels, 40)
    with pytest.raises(ValueError, match="gemm_packed takes"):  # another weight's panels
        kernels.gemm_packed(torch.randn(4, 16), panels, 70)
    with pytest.raises(ValueError, match="bias"):
        kernels.gemm_packed(torch.randn(4, 16), panels, 40, torch.randn(39))
    with pytest.raises(ValueError, match="pack_panels takes"):
        kernels.pack_panels(w.double())
    # a strided x is the caller's to make contiguous: the per-call check says no
    assert kernels.gemm_packed_checked(torch.randn(16, 4).T, panels, 40, None) is None


@pytest.mark.parametrize("shape", [(1, 512), (33, 512), (200, 512), (5, 7), (2, 3, 64), (0, 16)])
def test_rms_norm_is_torchs(kernels: NativeKernels, shape: tuple[int, ...]) -> None:
    """Widths that fill the vector lanes and ones that do not; enough rows to split them
    over the threads (200 x 512); a 3-d input; no rows at all."""
    torch.manual_seed(len(shape) + shape[-1])
    x, w = torch.randn(*shape) * 3, torch.randn(shape[-1])
    out = kernels.rms_norm(x, w, 1e-6)
    assert out is not None
    torch.testing.assert_close(out, F.rms_norm(x, (shape[-1],), w, 1e-6))


@pytest.mark.parametrize("shape", [(1, 2816), (32, 2816), (3, 14), (2, 42), (2, 3, 64)])
def test_silu_and_mul_is_torchs(kernels: NativeKernels, shape: tuple[int, ...]) -> None:
    """Including gates far out on both sides (where e^-g would overflow) and infinite
    ones, in the vectorised part of a row and in its scalar tail: as torch, everywhere."""
    torch.manual_seed(shape[-1])
    gate_up = torch.randn(*shape) * 8
    half = shape[-1] // 2
    edge = torch.tensor([-120.0, 120.0, -0.0, 1e-30, float("inf"), float("-inf"), -1e30])
    gate_up.view(-1, shape[-1])[0, :7] = edge[: min(7, half)].repeat(7)[: min(7, half)]
    gate_up.view(-1, shape[-1])[-1, half - 3:half] = edge[4:7][-min(3, half):]
    out = kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert out is not None
    torch.testing.assert_close(out, F.silu(gate) * up, equal_nan=True)


@pytest.mark.parametrize("tokens,dim", [(1, 64), (5, 16), (37, 6)])
def test_rope_is_the_rotate_half_formula(kernels: NativeKernels, tokens: int, dim: int) -> None:
    """On the q|k head slice of a fused qkv row, as the model passes it."""
    from engine.models.rotary import RotaryEmbedding

    torch.manual_seed(tokens)
    rotary = RotaryEmbedding(dim, 512, 10000.0, None)
    cos, sin = rotary.cos_sin(torch.randint(0, 512, (tokens,)), torch.float32)
    qkv = torch.randn(tokens, 7 * dim)
    qk = qkv[:, :5 * dim].view(tokens, 5, dim)
    x1, x2 = qk.chunk(2, dim=-1)
    out = kernels.rope(qk, cos, sin)
    assert out is not None
    torch.testing.assert_close(out, qk * cos + torch.cat((x2, x1), dim=-1) * sin)
    assert kernels.rope(qk.transpose(0, 1), cos, sin) is None  # heads not contiguous


@pytest.mark.parametrize("slots", [[17, 3, 40, 0, 63, 22], [5], [9, 30, 9]])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_is_index_copy(kernels: NativeKernels, slots: list[int],
                                slot_dtype: torch.dtype) -> None:
    """k and v with different token strides, as the model passes them (k from the
    rotated q|k heads, v from the fused projection); slots in any order, one token, a
    slot written twice (the later token wins, as with index_copy_)."""
    from engine.attention.torch_backend import write_kv

    torch.manual_seed(4)
    tokens = len(slots)
    k = torch.randn(tokens, 6, 16)[:, 4:]  # heads 4..5 of 6: token stride 96
    v = torch.randn(tokens, 8 * 16)[:, 96:].view(tokens, 2, 16)  # token stride 128
    mapping = torch.tensor(slots, dtype=slot_dtype)
    ours, theirs = torch.zeros(2, 8, 8, 2, 16), torch.zeros(2, 8, 8, 2, 16)
    assert kernels.write_kv(ours, k, v, mapping)
    write_kv(theirs, k, v, mapping.long())
    assert torch.equal(ours, theirs)


def test_write_kv_refuses_what_it_does_not_take(kernels: NativeKernels) -> None:
    """A slot outside the cache raises before anything is written; slot maps and caches
    of other kinds are left to torch."""
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    cache = torch.zeros(2, 8, 8, 2, 16)
    with pytest.raises(IndexError, match="outside the cache"):
        kernels.write_kv(cache, k, v, torch.tensor([1, 2, 64]))
    assert not cache.any()
    for slots in (torch.tensor([1.7, 2.2, 3.9]), torch.tensor([[1], [2], [3]])):
        assert not kernels.write_kv(cache, k, v, slots)
    assert not kernels.write_kv(cache.double(), k.double(), v.double(), torch.tensor([1, 2, 3]))
    assert not kernels.write_kv(cache[:1], k, v, torch.tensor([1, 2, 3]))
    assert not cache.any()


def test_argmax_rows_is_torchs(kernels: NativeKernels) -> None:
    """Random rows, ties (the first wins), NaN (the first NaN wins), -inf and constant
    rows, widths off the vector lanes, and a row-strided view."""
    torch.manual_seed(3)
    x = torch.randn(40, 32003)
    x[1, 7] = x[1, 20000] = 50.0  # a tie
    x[2, 30000], x[2, 5] = float("nan"), float("nan")
    x[3] = float("-inf")
    x[4] = 1.5
    x[5, -1] = 99.0  # in the tail past the last full vector
    # ties across the kernel's lanes and its sets of them (16 lanes x 4 with AVX-512): the
    # later one in a lower lane, in another set, in a later pass, and -0.0 against 0.0
    x[6, 2] = x[6, 17] = 60.0
    x[7, 70] = x[7, 9] = x[7, 200] = 61.0
    x[8, 31] = x[8, 64 + 31] = x[8, 16] = 62.0
    x[9] = -1.0
    x[9, 40], x[9, 3] = 0.0, -0.0
    x[10, 0] = 70.0  # the very first
    x[11, 31999], x[11, 3] = float("inf"), float("inf")
    x[12, 32002] = float("nan")  # NaN only in the tail
    for view in (x, x[:, :31000], x[:, :5], x[:0], x[:, :1], x[:, :16], x[:, :63], x[:, :64],
                 x[:, :65], x[:, :129]):
        out = kernels.argmax_rows(view)
        assert out is not None and torch.equal(out, view.argmax(dim=-1)), view.shape
    assert kernels.argmax_rows(x.T) is None and kernels.argmax_rows(x[0]) is None


def test_norm_and_activation_leave_what_they_do_not_take_to_torch(kernels: NativeKernels) -> None:
    x = torch.randn(4, 32)
    assert kernels.rms_norm(x.T, torch.randn(4), 1e-6) is None  # not contiguous
    assert kernels.rms_norm(x.double(), torch.randn(32).double(), 1e-6) is None
    assert kernels.rms_norm(x, torch.randn(31), 1e-6) is None
    assert kernels.silu_and_mul(torch.randn(4, 7)) is None  # odd width
    assert kernels.silu_and_mul(x.T) is None


def test_decode_attention_refuses_tables_that_point_outside_the_cache(
        kernels: NativeKernels) -> None:
    kv_cache = torch.randn(2, 4, 16, 2, 16)
    q = torch.randn(2, 4, 16)
    tables = torch.tensor([[0, 1], [2, 3]])
    ok = kernels.paged_decode_attention(q, kv_cache, tables, torch.tensor([17, 32]), 0.25)
    assert ok.shape == (2, 4, 16) and torch.isfinite(ok).all()
    with pytest.raises(ValueError, match="block id outside the cache"):
        kernels.paged_decode_attention(q, kv_cache, torch.tensor([[0, 1], [2, 4]]),
                                       torch.tensor([17, 32]), 0.25)
    with pytest.raises(ValueError, match="context length outside its block table"):
        kernels.paged_decode_attention(q, kv_cache, tables, torch.tensor([17, 33]), 0.25)
    with pytest.raises(ValueError, match="context length outside its block table"):
        kernels.paged_decode_attention(q, kv_cache, tables, torch.tensor([0, 3]), 0.25)
    with pytest.raises(ValueError, match="do not match"):
        kernels.paged_decode_attention(q, kv_cache, tables[:1], torch.tensor([17]), 0.25)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_kernels_share_torchs_openmp_runtime(kernels: NativeKernels) -> None:
    """One libgomp in the process: the kernels' threads are torch's, not a second pool
    spinning against it on the same cores."""
    kernels.gemv(torch.randn(1, 64), torch.randn(64, 64))
    with open("/proc/self/maps", encoding="utf-8") as f:
        runtimes = {line.split()[-1] for line in f
                    if any(name in line for name in ("libgomp", "libomp", "libiomp"))}
    assert len(runtimes) == 1, runtimes


def test_the_library_is_built_once_per_source(tmp_path: Path) -> None:
    """Concurrent builders end with one library; another source gets another file."""
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(build(directory=tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(paths) == 3 and len(set(paths)) == 1 and paths[0].exists()
    # no temporary left: the build lock, the library and its digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build.lock", paths[0].name,
                                                          paths[0].name + ".sha256"]
    other = tmp_path / "other"
    other.mkdir()
    for source in source_files(SOURCES):
        (other / source.name).write_text(source.read_text())
    assert library_path(other, tmp_path) == paths[0]  # the same sources: the same library
    header = other / "kernels.h"
    header.write_text(header.read_text() + "\n/* changed */\n")
    assert library_path(other, tmp_path) != paths[0]  # a header is a source too


def _probe(env: dict[str, str]) -> list[str]:
    """What a fresh process gets with ``env``: the kernels, the attention backend,
    the linear kernels on offer, then its stderr lines."""
    code = ("import torch\n"
            "from engine.kernels.cpu import native\n"
            "from engine.attention import select_backend\n"
            "from engine.kernels.linear import available_kernels\n"
            "print(native() is not None)\n"
            "print(select_backend(torch.device('cpu'), 16, torch.float32).name)\n"
            "print(','.join(available_kernels(torch.device('cpu'), torch.float32)))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines() + done.stderr.splitlines()


def test_switched_off_the_engine_uses_its_torch_kernels(tmp_path: Path) -> None:
    out = _probe({"PDSERVE_CPU_KERNELS": "0", "XDG_CACHE_HOME": str(tmp_path)})
    assert out[:2] == ["False", "torch"] and "onednn_gemv" not in out[2].split(",")
    assert not (tmp_path / "pdserve" / "kernels").exists()  # nothing was built


def test_without_a_working_compiler_the_engine_uses_its_torch_kernels(tmp_path: Path) -> None:
    """A failing build is logged once with the compiler's words, not raised."""
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake-cc 1.0; exit 0; }\n"
                       "echo 'fake-cc: cannot compile here' >&2\nexit 1\n")
    failing.chmod(0o755)
    out = _probe({"CC": str(failing), "XDG_CACHE_HOME": str(tmp_path)})
    assert out[:2] == ["False", "torch"] and "onednn_gemv" not in out[2].split(",")
    warnings = [line for line in out[3:] if "compiled CPU kernels are unavailable" in line]
    assert len(warnings) == 1 and "fake-cc: cannot compile here" in "\n".join(out[3:])


def test_with_a_compiler_the_engine_uses_the_compiled_kernels(tmp_path: Path) -> None:
    out = _probe({"XDG_CACHE_HOME": str(tmp_path)})
    if out[0] != "True":
        pytest.skip("pdserve's compiled CPU kernels could not be built here")
    assert out[1] == "cpu" and "onednn_gemv" in out[2].split(",")
    assert len(list((tmp_path / "pdserve" / "kernels").glob("*.so"))) == 1


def test_a_damaged_cached_library_is_built_again(tmp_path: Path) -> None:
    """A library cut short (loading it would kill the process with SIGBUS) or emptied
    is noticed by its digest and rebuilt, in the next process that wants it."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    if _probe(env)[0] != "True":
        pytest.skip("pdserve's compiled CPU kernels could not be built here")
    (library,) = (tmp_path / "pdserve" / "kernels").glob("*.so")
    for damage in (1000, 0):
        with open(library, "r+b") as f:
            f.truncate(damage)
        assert _probe(env)[:2] == ["True", "cpu"]
        assert library.stat().st_size > 1000


def test_a_compiler_command_with_arguments_is_run_as_one(tmp_path: Path) -> None:
    """``CC="env cc"`` (as ``CC="ccache gcc"``) is split like a shell would."""
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None or shutil.which("env") is None:
        pytest.skip("no C compiler here")
    assert _probe({"CC": f"env {cc}", "XDG_CACHE_HOME": str(tmp_path)})[:2] == ["True", "cpu"]


def _has_avx2() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return all(f in flags.split() for f in ("avx2", "fma", "bmi2"))


@pytest.mark.skipif(not _has_avx2(), reason="needs an x86-64 CPU with AVX2")
@pytest.mark.timeout(300)
def test_the_kernels_built_for_avx2_compute_the_same(tmp_path: Path,
                                                     kernels: NativeKernels) -> None:
    """The same source for an AVX2 machine (8-float vectors, the GEMM's 16-wide panels):
    this module's kernel tests, the int8 and sampling ones and the decoder stack's (to the
    bit against the per-layer forward) again, on a library built with -march=x86-64-v3."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDSERVE_CPU_KERNELS", "PDSERVE_CPU_DECODER_STACK", "PDSERVE_LINEAR_KERNEL")}
    env.update(PDSERVE_CPU_KERNELS_MARCH="x86-64-v3", XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         str(Path(__file__).parents[1] / "models" / "test_decoder_stack.py"),
         str(Path(__file__).with_name("test_int8.py")),
         str(Path(__file__).with_name("test_sampling_kernels.py")), "-k", "not avx2",
         "--basetemp", str(tmp_path / "t")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
    built = list((tmp_path / "cache" / "pdserve" / "kernels").glob("pdserve_kernels-*.so"))
    assert len(built) == 1  # one library, for that target, not this machine's own


def test_a_bad_march_target_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from engine.kernels.cpu.build import BuildError, build

    monkeypatch.setenv("PDSERVE_CPU_KERNELS_MARCH", "native; rm -rf /")
    with pytest.raises(BuildError, match="not a -march target"):
        build(directory=tmp_path)
