"""The decoder stack's Python face (``decoder.c``): a decode step of every layer in one
call, and the step from token ids to the final norm."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu._ffi import bind, cint, i64, ptr
from engine.kernels.cpu.stack_layout import (
    DecoderLayers,
    DecoderShape,
    _raise_for,
    _work_space,
    decoder_step_takes,
)


class StackKernels:
    """``NativeKernels``' decoder stack and decode step."""

    def _bind_stack(self, library: ctypes.CDLL) -> None:
        self._stack = bind(library, "pd_decoder_stack_f32",
                           [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, cint])
        self._stack_scratch = bind(library, "pd_decoder_scratch_floats", [ptr], i64)
        self._step = bind(library, "pd_decoder_step_f32",
                          [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, cint])
        self._step_scratch = bind(library, "pd_decoder_step_scratch_floats", [ptr], i64)
        self._stack_shape_ok = bind(library, "pd_decoder_shape_ok", [ptr])

    def supports_decoder_stack(self, shape: DecoderShape) -> bool:
        """Whether ``decoder_stack`` takes a stack of these sizes (the attention kernel's
        limits: head dim a multiple of 16, at most 64 query heads per KV head)."""
        return bool(self._stack_shape_ok(ctypes.byref(shape)))

    def decoder_stack(self, layers: DecoderLayers, h: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor) -> None:
        """A decode step of a whole decoder stack in one call (``DecoderLayers``): ``h
        [B, hidden]`` (contiguous fp32, one token for each of ``B <= layers.max_rows``
        sequences) goes in as the embeddings and comes out as the last layer's output,
        each layer's K/V written to its cache;
        ``cos``, ``sin [B, 1, D]`` as ``rope`` takes them; ``slot_mapping [B]``,
        ``block_tables [B, max_blocks]`` and ``context_lens [B]`` (int64) as
        ``write_kv`` and ``paged_decode_attention`` take them. The same kernels in the same
        order as the model's per-layer forward, so the same result to the bit. Raises
        ``ValueError`` for inputs of other shapes or types, ``IndexError`` for a slot or
        block outside the cache (checked before anything is written)."""
        rows = h.shape[0] if h.dim() == 2 else 0
        shape = layers.shape
        width = shape.head_dim
        if not (0 < rows <= layers.max_rows and h.shape[1] == shape.hidden and h.dtype == torch.float32
                and h.is_contiguous() and h.device.type == "cpu"
                and cos.shape == sin.shape == (rows, 1, width) and cos.is_contiguous()
                and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32
                and cos.device.type == sin.device.type == "cpu"
                and slot_mapping.shape == (rows,) and context_lens.shape == (rows,)
                and block_tables.dim() == 2 and block_tables.shape[0] == rows
                and block_tables.shape[1] > 0
                and all(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu"
                        for t in (slot_mapping, block_tables, context_lens))):
            raise ValueError(f"decoder_stack does not take h {tuple(h.shape)} {h.dtype} "
                             f"with these cos/sin, slots, tables and lengths")
        scratch = _work_space(layers, rows, self._stack_scratch(ctypes.byref(shape)))
        rc = self._stack(layers.table, len(layers.table), ctypes.byref(shape), h.data_ptr(), rows,
                         cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                         block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
                         scratch.data_ptr(), torch.get_num_threads())
        _raise_for("decoder_stack", rc)

    def decoder_step(self, layers: DecoderLayers, token_ids: torch.Tensor,
                     positions: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """A decode step up to the LM head in one call, over ``DecoderLayers`` built with
        ``ends``: the embeddings of ``token_ids [B]``, RoPE at ``positions [B]``,
        ``decoder_stack``, the final norm; returns its output ``[B, hidden]`` (a new
        tensor), the same to the bit as the model's forward, and writes each layer's K/V.
        Slots, tables and lengths as ``decoder_stack`` takes them. Raises ``ValueError``
        for inputs ``decoder_step_takes`` refuses (layers built without ends among them),
        ``IndexError`` for a token id outside the embedding, a position outside the RoPE
        tables, or a slot or block outside the cache (all checked before anything is
        written)."""
        if not decoder_step_takes(layers, token_ids, positions, slot_mapping, block_tables,
                                  context_lens):
            raise ValueError(f"decoder_step does not take token ids {tuple(token_ids.shape)} "
                             "with these positions, slots, tables and lengths"
                             + ("" if layers.ends_table is not None else
                                " (its layers were built without ends)"))
        assert layers.ends_table is not None  # decoder_step_takes said yes
        rows = token_ids.shape[0]
        shape = layers.shape
        scratch = _work_space(layers, rows, self._step_scratch(ctypes.byref(shape)))
        out = torch.empty(rows, shape.hidden, dtype=torch.float32)
        rc = self._step(layers.table, len(layers.table), ctypes.byref(shape),
                        ctypes.byref(layers.ends_table), token_ids.data_ptr(),
                        positions.data_ptr(), rows, slot_mapping.data_ptr(),
                        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
                        out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
        _raise_for("decoder_step", rc)
        return out
