"""QuantLinear and QuantEmbedding: the runtime modules of packed weights.

A QuantLinear replaces nn.Linear and holds its matrix as one or more row segments, each a
QuantizedTensor in its own format, stacked along the output dim. A fused projection whose parts
share a format is one segment; a GGUF Q4_K_M file, whose v_proj is often Q6_K beside Q4_K q/k,
makes qkv_proj two. The kernels read every segment in place (kernels/dispatch.py); the
reference path dequantizes a temporary for one forward call.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from qserve.formats import QuantizedTensor, ggml
from qserve.formats.qtensor import stackable
from qserve.kernels import cpu_ops
from qserve.kernels.dispatch import packed_linear

_PARTS = ("qweight", "scales", "offsets")
LAYOUT_ROWS = 256  # rows a load lays out at a time (QuantLinear.laid_out); a multiple of 16


class QuantLinear(nn.Module):
    def __init__(self, segments: list[QuantizedTensor], bias: torch.Tensor | None = None):
        super().__init__()
        assert segments and len({s.in_features for s in segments}) == 1
        self.in_features = segments[0].in_features
        self.out_features = sum(s.shape[0] for s in segments)
        self.formats = [s.format for s in segments]
        for i, seg in enumerate(segments):  # buffers, so .to(device) moves them
            for part in _PARTS:
                self.register_buffer(f"s{i}_{part}", getattr(seg, part))
        self.register_buffer("bias", bias)  # (out,) or None
        self._cached = (None, None, None)  # (buffers' key, segments, all cpu_ops.supports)

    @classmethod
    def on_device(cls, segments: list[QuantizedTensor], bias: torch.Tensor | None,
                  device: torch.device) -> "QuantLinear":
        """A QuantLinear on `device` with its segments in the layout that device's kernels run
        fastest: on the CPU cpu_ops.runtime_layout (q4_k, q6_k and int4 with 16 rows
        interleaved where the kernels run that: the same weights)."""
        segments = [cls.device_layout(s, device) for s in segments]
        return cls(segments, bias).to(device)

    @staticmethod
    def device_layout(seg: QuantizedTensor, device: torch.device,
                      out: QuantizedTensor | None = None, row: int = 0) -> QuantizedTensor:
        """One segment in the layout on_device gives it. out: a matrix in that layout
        (device_format; ggml.empty_rows) to write it into instead, at rows row .. row + seg's,
        and return: a loader lays a large matrix out a slice at a time, and a fused matrix's
        parts one after the other, straight into the stack (the _x16 layouts interleave rows
        16 at a time, so stacking parts of a multiple of 16 rows commutes with interleaving),
        so the file's copy of a part is never whole beside its layout."""
        if device.type != "cpu" and out is None:
            return seg  # other devices run the file's layout (there out is seg's: rows copied)
        return cpu_ops.runtime_layout(seg, out, row)

    @staticmethod
    def device_format(seg: QuantizedTensor, device: torch.device) -> str:
        """The format device_layout lays seg out in."""
        return cpu_ops.layout_format(seg) if device.type == "cpu" else seg.format

    @classmethod
    def laid_out(cls, parts: list[tuple[int, Callable[[int, int], QuantizedTensor]]],
                 device: torch.device,
                 check: Callable[[QuantizedTensor], None] = lambda p: None
                 ) -> list[QuantizedTensor]:
        """Matrices stacked along the output rows, each given as (rows, read) with read(r0,
        r1) its rows r0 .. r1 as the file holds them (check raises on a bad slice), read
        LAYOUT_ROWS rows at a time and put in the device's layout (device_layout) straight
        into their place: neighbouring parts that stack (stackable, in one layout: a fused
        gate/up of one type) share one output, the others get their own. The load holds the
        outputs and one slice per part (a reader reuses its buffer: tensor_rows), never a
        file's whole copy beside its layout nor a stack of laid-out parts, and lays each
        slice out without temporaries where the C kernels are built (x16_interleave). Slices
        are a multiple of 16 rows, so an interleaved layout (16 rows at a time) is the whole
        part's; a part of another row count is read whole. Returns the segments."""
        def piece(read, r0: int, r1: int) -> QuantizedTensor:
            p = read(r0, r1)
            check(p)
            return p

        firsts = [piece(read, 0, rows if rows <= LAYOUT_ROWS or rows % 16 else LAYOUT_ROWS)
                  for rows, read in parts]  # as read: each part's reader holds it
        formats = [cls.device_format(p, device) for p in firsts]
        segments, i = [], 0
        while i < len(parts):
            j = i + 1
            while j < len(parts) and formats[j] == formats[i] and stackable(firsts[i], firsts[j]):
                j += 1
            total = sum(rows for rows, _ in parts[i:j])
            if j == i + 1 and firsts[i].shape[0] == total:  # one part, read whole
                segments.append(cls.device_layout(firsts[i], device))
                i = j
                continue
            head = firsts[i]
            out = ggml.empty_rows(head, total, formats[i])
            at = 0
            for k in range(i, j):
                rows, read = parts[k]
                r0 = 0
                while r0 < rows:
                    p = firsts[k] if r0 == 0 else piece(read, r0, min(rows, r0 + LAYOUT_ROWS))
                    if not stackable(head, p):
                        raise ValueError(f"rows {r0}.. read as {p.format}, not {head.format}")
                    cls.device_layout(p, device, out, at + r0)
                    r0 += p.shape[0]
                firsts[k] = None  # in place: its reader's buffer is the next slice's
                at += rows
            segments.append(out)
            i = j
        return segments

    def _views(self) -> tuple[list[QuantizedTensor], bool]:
        """The segments and whether the C kernels run all of them, made once per set of buffers
        (a per-layer decode step calls this every linear, every token: rebuilding and
        validating the segments each time cost about half of a small matmul)."""
        bufs = [getattr(self, f"s{i}_{p}") for i in range(len(self.formats)) for p in _PARTS]
        key = tuple(None if t is None else (t.data_ptr(), t.device, t.shape) for t in bufs)
        if self._cached[0] != key:
            segs = [QuantizedTensor(f, *bufs[len(_PARTS) * i:len(_PARTS) * (i + 1)],
                                    self.in_features) for i, f in enumerate(self.formats)]
            self._cached = (key, segs, all(cpu_ops.supports(s) for s in segs))
        return self._cached[1], self._cached[2]

    @property
    def segments(self) -> list[QuantizedTensor]:
        """Row blocks in output order, (out_i, in) each."""
        return list(self._views()[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) -> (..., out)."""
        segments, cpu_ready = self._views()
        return packed_linear(x, segments, self.bias, cpu_ready=cpu_ready)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"formats={'+'.join(self.formats)}")


class QuantEmbedding(nn.Module):
    """A packed token embedding (vocab, hidden), in any weight format: a lookup dequantizes
    only the rows it reads. Tied to the output, `logits` runs the packed matmul kernel, or on
    the reference path dequantizes the table a slice of rows at a time, so the full-precision
    table never exists whole."""

    ROWS_PER_SLICE = 8192

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = qt.shape[0], qt.in_features, dtype
        self.format = qt.format
        self._c_rows_for: tuple = (None, False)  # (the table's storage, whether C decodes it)
        for part in _PARTS:
            self.register_buffer(part, getattr(qt, part))  # (vocab, ...) rows

    @classmethod
    def on_device(cls, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device
                  ) -> "QuantEmbedding":
        """A QuantEmbedding on `device`, its table in the layout that device's kernels run the
        tied output's matmul fastest (QuantLinear.on_device); a lookup reads only the groups
        of rows it needs (QuantizedTensor.rows)."""
        return cls(QuantLinear.device_layout(qt, device), dtype).to(device)

    @property
    def table(self) -> QuantizedTensor:
        return QuantizedTensor(self.format, self.qweight, self.scales, self.offsets,
                               self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, hidden). On the CPU, through the C row decoders where they take the
        table (about 0.6 ms less a decode step than deinterleaving an _x16 table's group of 16
        rows in torch, for the same weights)."""
        table = self.table
        if input_ids.device.type == "cpu" and cpu_ops.lib() is not None and self._c_rows(table):
            return cpu_ops.weight_rows(table, input_ids).to(self.dtype)
        return table.rows(input_ids).dequantize().to(self.dtype)

    def _c_rows(self, table: QuantizedTensor) -> bool:
        """Whether the C kernels decode this table's rows; asked once per table storage."""
        key = (self.qweight.data_ptr(), self.qweight.device)
        if self._c_rows_for[0] != key:
            self._c_rows_for = (key, cpu_ops.supports(table))
        return self._c_rows_for[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> (S, vocab) fp32: hidden @ table^T."""
        table = self.table
        if hidden.device.type == "cpu" and cpu_ops.lib() is not None:
            return packed_linear(hidden.float(), [table], None, cpu_ready=self._c_rows(table))
        V, n = self.num_embeddings, self.ROWS_PER_SLICE
        return torch.cat([F.linear(hidden, table.rows(slice(i, min(i + n, V))).dequantize()
                                   .to(hidden.dtype)).float()
                          for i in range(0, V, n)], dim=-1)


class FileEmbedding(nn.Module):
    """An untied token embedding left in its file (a loader's FileRows: `rows(ids)`,
    `num_rows`, `in_features`): a lookup reads the distinct ids' rows, in the file's format,
    and decodes them as QuantEmbedding would the table's, so the table is never resident
    (Llama-3.1-8B's: 282 MiB as Q4_K, 1 GiB as F16). CPU only: a GPU run keeps its table on
    the device."""

    def __init__(self, source, dtype: torch.dtype):
        super().__init__()
        self.source, self.dtype = source, dtype
        self.num_embeddings, self.embedding_dim = source.num_rows, source.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) (any shape) -> (*ids.shape, hidden)."""
        flat = input_ids.reshape(-1).tolist()
        if not flat:
            return torch.empty(*input_ids.shape, self.embedding_dim, dtype=self.dtype)
        ids = sorted(set(flat))  # each row read once (a step's few ids: faster than torch's)
        if ids[0] < 0 or ids[-1] >= self.num_embeddings:
            raise IndexError(f"a token id outside the embedding table's {self.num_embeddings} "
                             f"rows")
        slot = {t: k for k, t in enumerate(ids)}
        where = torch.tensor([slot[t] for t in flat], dtype=torch.int64)
        rows = self.source.rows(ids)
        if not isinstance(rows, QuantizedTensor):  # dense rows as stored
            out = rows[where]
        elif cpu_ops.lib() is not None and cpu_ops.supports(rows):
            out = cpu_ops.weight_rows(rows, where)
        else:
            out = rows.dequantize()[where]
        return out.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)
