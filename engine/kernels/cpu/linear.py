"""The linear kernels' Python face: the batch-1 to 3 GEMV (``gemv.c``) and the GEMM over
weights packed in panels (``gemm.c``), each over fp32 weights or int8 ones with an fp32
scale per output feature (``engine.kernels.quant``)."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu._ffi import GEMV_MAX_ROWS, bind, cint, i64, ptr, ptr_of


class LinearKernels:
    """``NativeKernels``' GEMV and packed GEMM."""

    def _bind_linear(self, library: ctypes.CDLL) -> None:
        self._gemv = bind(library, "pd_gemv_f32", [ptr, i64, i64, ptr, i64, ptr, ptr, cint])
        self._gemm = bind(library, "pd_gemm_packed_f32",
                          [ptr, i64, i64, ptr, i64, ptr, ptr, cint])
        self._gemv_i8 = bind(library, "pd_gemv_i8", [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, cint])
        self._gemm_i8 = bind(library, "pd_gemm_packed_i8",
                             [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, cint])
        self._panel_floats = bind(library, "pd_gemm_panel_floats", [i64, i64], i64)
        # output features per panel of gemm_packed's weight
        self.panel_width = int(bind(library, "pd_gemm_panel_width", [], i64)())

    @staticmethod
    def supports_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``gemv`` takes these (at most ``GEMV_MAX_ROWS`` rows of ``x``)."""
        return (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
                and weight.device.type == "cpu" and x.numel() > 0 and weight.numel() > 0
                and x.numel() // x.shape[-1] <= GEMV_MAX_ROWS
                and x.is_contiguous() and weight.is_contiguous() and weight.dim() == 2
                and x.shape[-1] == weight.shape[1])

    def gemv(self, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ weight[out, in]^T + bias``, for a few rows of ``x``."""
        if not self.supports_gemv(x, weight):
            raise ValueError(f"gemv takes contiguous fp32 CPU tensors and at most "
                             f"{GEMV_MAX_ROWS} rows; got x {tuple(x.shape)} {x.dtype}, "
                             f"weight {tuple(weight.shape)} {weight.dtype}")
        if bias is not None:
            bias = bias.contiguous()
            if (bias.shape != (weight.shape[0],) or bias.dtype != torch.float32
                    or bias.device.type != "cpu"):
                raise ValueError(f"gemv bias must be fp32 [{weight.shape[0]}], got "
                                 f"{tuple(bias.shape)} {bias.dtype}")
        y = self.gemv_checked_weight(x, weight, bias)
        assert y is not None  # supports_gemv said yes
        return y

    def gemv_checked_weight(self, x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor | None:
        """``gemv`` for a caller that checked ``weight`` (contiguous fp32 CPU ``[out, in]``)
        and ``bias`` (``None`` or contiguous fp32 ``[out]``) once, at load: checks only
        ``x`` (per call), and returns ``None`` where ``x`` is not for the GEMV."""
        rows = self._gemv_rows(x, weight.shape[1])
        if rows == 0 or weight.shape[0] == 0:
            return None
        n = weight.shape[0]
        y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        rc = self._gemv(x.data_ptr(), rows, x.shape[-1], weight.data_ptr(), n, ptr_of(bias),
                        y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"gemv refused its arguments (code {rc})")
        return y

    def panel_floats(self, out_features: int, in_features: int) -> int:
        """Floats of ``pack_panels`` of an ``[out_features, in_features]`` weight."""
        return int(self._panel_floats(out_features, in_features))

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [out, in]`` (fp32 or int8, CPU) in ``gemm_packed``'s (or
        ``gemm_packed_i8``'s) layout: panels of ``panel_width`` output features, each
        ``[in, panel_width]`` (``W^T`` of those rows; the last panel padded with zeros),
        one flat tensor of the weight's dtype."""
        if (weight.dim() != 2 or weight.dtype not in (torch.float32, torch.int8)
                or weight.device.type != "cpu"):
            raise ValueError(f"pack_panels takes a 2-d fp32 or int8 CPU weight, got "
                             f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
        n, k = weight.shape
        width = self.panel_width
        padded = torch.zeros(-(-n // width) * width, k, dtype=weight.dtype)
        padded[:n] = weight
        panels = padded.view(-1, width, k).transpose(1, 2).contiguous().view(-1)
        assert panels.numel() == self._panel_floats(n, k)
        return panels

    def gemm_packed(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ W^T + bias`` from ``panels = pack_panels(W)``, any number of
        rows (the decode batches between the GEMV and a prefill chunk are what it is
        for)."""
        k = x.shape[-1] if x.dim() else 0
        if not (x.dtype == panels.dtype == torch.float32 and x.device.type == "cpu"
                and panels.device.type == "cpu" and panels.is_contiguous() and k > 0
                and x.numel() > 0 and out_features > 0 and panels.numel() == self._panel_floats(out_features, k)):
            raise ValueError(f"gemm_packed takes fp32 CPU tensors and panels of a "
                             f"[{out_features}, {k}] weight; got x {tuple(x.shape)} {x.dtype}, "
                             f"{panels.numel()} panel floats")
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32
                                 or bias.device.type != "cpu"):
            raise ValueError(f"gemm_packed bias must be fp32 [{out_features}], got "
                             f"{tuple(bias.shape)} {bias.dtype}")
        y = self.gemm_packed_checked(x.contiguous(), panels, out_features,
                                     None if bias is None else bias.contiguous())
        assert y is not None
        return y

    def gemm_packed_checked(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                            bias: torch.Tensor | None) -> torch.Tensor | None:
        """``gemm_packed`` for a caller that made ``panels`` with ``pack_panels`` and
        checked ``bias`` once, at load: checks only ``x`` (per call); ``None`` where ``x``
        is not contiguous fp32 on the CPU with the weight's ``in`` features."""
        rows = self._gemm_rows(x, panels, out_features)
        if rows == 0:
            return None
        y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
        rc = self._gemm(x.data_ptr(), rows, x.shape[-1], panels.data_ptr(), out_features,
                        ptr_of(bias), y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"gemm_packed refused its arguments (code {rc})")
        return y

    # ------------------------------------------------------------ int8 weights

    def gemv_i8_checked(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
        """``(x [..., in] @ q^T) * scales + bias`` for an int8 ``q [out, in]`` and fp32
        ``scales [out]`` (contiguous CPU, checked once by the caller, as ``bias``), a few
        rows of ``x``; ``None`` where ``x`` is not for the GEMV."""
        rows = self._gemv_rows(x, q.shape[1])
        if rows == 0 or q.shape[0] == 0:
            return None
        n = q.shape[0]
        y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        rc = self._gemv_i8(x.data_ptr(), rows, x.shape[-1], q.data_ptr(), scales.data_ptr(), n,
                           ptr_of(bias), y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"gemv_i8 refused its arguments (code {rc})")
        return y

    def gemm_packed_i8_checked(self, x: torch.Tensor, panels: torch.Tensor,
                               scales: torch.Tensor, out_features: int,
                               bias: torch.Tensor | None) -> torch.Tensor | None:
        """``gemm_packed_checked`` over int8 ``panels = pack_panels(q)`` with their fp32
        ``scales [out]``; ``None`` where ``x`` is not contiguous fp32 on the CPU with the
        weight's ``in`` features."""
        rows = self._gemm_rows(x, panels, out_features)
        if rows == 0:
            return None
        y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
        rc = self._gemm_i8(x.data_ptr(), rows, x.shape[-1], panels.data_ptr(), scales.data_ptr(),
                           out_features, ptr_of(bias), y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"gemm_packed_i8 refused its arguments (code {rc})")
        return y

    @staticmethod
    def _gemv_rows(x: torch.Tensor, in_features: int) -> int:
        """Rows of ``x`` the GEMV takes (contiguous fp32 CPU, ``in_features`` wide, at most
        ``GEMV_MAX_ROWS``), else 0."""
        if x.dim() == 0 or x.shape[-1] == 0:
            return 0
        rows = x.numel() // x.shape[-1]
        ok = (0 < rows <= GEMV_MAX_ROWS and x.dtype == torch.float32 and x.is_contiguous()
              and x.device.type == "cpu" and x.shape[-1] == in_features)
        return rows if ok else 0

    def _gemm_rows(self, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> int:
        """Rows of ``x`` the packed GEMM takes (contiguous fp32 CPU, as wide as the
        ``[out_features, in]`` weight ``panels`` hold), else 0."""
        if x.dim() == 0 or x.numel() == 0 or not (
                x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
                and panels.numel() == self._panel_floats(out_features, x.shape[-1])):
            return 0
        return x.numel() // x.shape[-1]
