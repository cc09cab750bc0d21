"""Whole KV blocks out of and into the worker's paged KV cache, as bytes of the KVLayout's shape.

On CPU the cache is read and written through numpy views, so a connector may copy blocks on its own threads
without running a torch op off the engine thread (a second OpenMP pool would slow every step)."""

import numpy as np

from engine.kv.layout import KVLayout


class KVBlockIO:
    """Reads and writes whole blocks of one KV cache group: its layers' K and V cache (layout.layer_ids), or with
    MLA each layer's one latent cache [blocks, block size, head size], whose block is already contiguous."""

    def __init__(self, kv_caches, layout: KVLayout):
        self.layout = layout
        if layout.layer_ids:
            kv_caches = [kv_caches[layer] for layer in layout.layer_ids]
        self.mla = layout.is_mla
        first = kv_caches[0] if self.mla else kv_caches[0][0]
        self.on_cpu = first.device.type == "cpu"
        if self.on_cpu:
            kv_caches = [self._view(c) if self.mla else (self._view(c[0]), self._view(c[1])) for c in kv_caches]
        self.caches = kv_caches
        self.np_dtype = (kv_caches[0] if self.mla else kv_caches[0][0]).dtype if self.on_cpu else None

    @staticmethod
    def _view(t):
        import torch  # here: only a worker, which has torch, makes a KVBlockIO

        # numpy has no bfloat16 or float8: move their bits as integers of their size, which is all a copy needs.
        bits = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
        return t.view(bits.get(t.dtype, t.dtype)).numpy()

    def read(self, block_ids: list[int]) -> list[bytes]:
        """The blocks' bytes (each of the layout's shape)."""
        if not self.on_cpu:
            return self._read_torch(block_ids)
        ids = np.asarray(block_ids)
        out = np.empty((len(ids), *self.layout.shape), dtype=self.np_dtype)
        if self.mla:
            for layer, latents in enumerate(self.caches):
                out[:, layer] = latents[ids]
            return [block.tobytes() for block in out]
        for layer, (k, v) in enumerate(self.caches):
            out[:, layer, 0] = k[:, ids].swapaxes(0, 1)
            out[:, layer, 1] = v[:, ids].swapaxes(0, 1)
        return [block.tobytes() for block in out]

    def write(self, block_ids: list[int], data) -> None:
        """data: the blocks' bytes back to back (any buffer), one block for each id."""
        if not self.on_cpu:
            return self._write_torch(block_ids, data)
        ids = np.asarray(block_ids)
        blocks = np.frombuffer(data, dtype=self.np_dtype).reshape(len(ids), *self.layout.shape)
        if self.mla:
            for layer, latents in enumerate(self.caches):
                latents[ids] = blocks[:, layer]
            return
        for layer, (k, v) in enumerate(self.caches):
            k[:, ids] = blocks[:, layer, 0].swapaxes(0, 1)
            v[:, ids] = blocks[:, layer, 1].swapaxes(0, 1)

    def _read_torch(self, block_ids):
        import torch

        if self.mla:
            ids = torch.tensor(block_ids, device=self.caches[0].device)
            out = torch.stack([latents[ids] for latents in self.caches], dim=1).cpu()  # [n, L, bs, head size]
        else:
            ids = torch.tensor(block_ids, device=self.caches[0][0].device)
            out = torch.stack([torch.stack([k[:, ids], v[:, ids]]) for k, v in self.caches])  # [L, 2, H, n, bs, D]
            out = out.permute(3, 0, 1, 2, 4, 5).contiguous().cpu()
        raw = out.view(torch.uint8).numpy()
        return [block.tobytes() for block in raw]

    def _write_torch(self, block_ids, data):
        import torch

        first = self.caches[0] if self.mla else self.caches[0][0]
        ids = torch.tensor(block_ids, device=first.device)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(first.dtype)
        data = raw.view(len(block_ids), *self.layout.shape).to(first.device)
        if self.mla:
            for layer, latents in enumerate(self.caches):
                latents[ids] = data[:, layer]
            return
        for layer, (k, v) in enumerate(self.caches):
            k[:, ids] = data[:, layer, 0].transpose(0, 1)
            v[:, ids] = data[:, layer, 1].transpose(0, 1)
