"""The engine core's multi-modal inputs, vLLM's MultiModalFeatureSpec: per image its processed tensors, where its
embeddings go in the prompt's token ids and its content hash. Plain tensors only, so any front end (the offline
LLM's processor, a tokenizer service, a router that preprocessed the image) can fill them in.

The hash names the image's embeddings in the encoder cache and its placeholder blocks in the prefix cache, so it
depends on the pixels alone: sha256 over each tensor's name, dtype, shape and bytes (never pickle)."""

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlaceholderRange:
    """The image's embedding tokens: prompt token ids [offset, offset + length), each the model's image token."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultiModalFeatureSpec:
    """One image of a request (vLLM's name). data: the model's processed tensors for this image alone (LLaVA:
    pixel_values [1, 3, H, W]); identifier: its content hash (hex), shared by every request with the same image;
    mm_position: its placeholder range; the encoder yields mm_position.length embeddings for it."""

    data: dict[str, torch.Tensor]
    identifier: str
    mm_position: PlaceholderRange
    modality: str = "image"

    @property
    def num_embeds(self) -> int:
        return self.mm_position.length


def hash_tensors(data: dict[str, torch.Tensor]) -> str:
    """The content hash of an image's processed tensors: the same pixels give the same hash in every process."""
    h = hashlib.sha256()
    for name in sorted(data):
        tensor = data[name].detach().cpu().contiguous()
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def find_placeholders(token_ids: list[int], image_token_id: int) -> list[PlaceholderRange]:
    """Each maximal run of image_token_id in token_ids, in order."""
    ranges, start = [], None
    for i, token in enumerate([*token_ids, None]):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            ranges.append(PlaceholderRange(start, i - start))
            start = None
    return ranges
