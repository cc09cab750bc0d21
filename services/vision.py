"""A vision-language model's images in the tokenizer service: llmmesh.v1.ImageInput (encoded bytes and their MIME
type, or a file under --allowed-local-media-path) decoded with PIL, then the model's Hugging Face processor
(engine.multimodal.processing.MultiModalProcessor, as the offline LLM runs it) for the token ids and one
MultiModalInput an image. Loads torch, so the tokenizer imports this module only for a vision-language model."""

import io
import re
from pathlib import Path

from engine.multimodal.checks import MultiModalLimits, image_info
from engine.multimodal.media import IMAGE_MIME_TYPES, load_image_bytes
from engine.multimodal.processing import MultiModalProcessor
from mesh.grpc_policy import MAX_MESSAGE_BYTES
from services.convert import mm_features_to_llmmesh

# How the offline processor names an image (multi_modal_data.image[i]); the service names the request's field.
_OFFLINE_ITEM = re.compile(r"multi_modal_data\.image\[(\d+)\]")


def read_local_media(path: str, where: str, allowed_root: str) -> bytes:
    """A file's bytes, if its resolved path (symbolic links followed) lies under allowed_root."""
    if not allowed_root:
        raise ValueError(
            f"{where}: local files are not accepted here (the tokenizer has no --allowed-local-media-path)"
        )
    root = Path(allowed_root).resolve()
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"{where}: {path[:256]!r} is not under --allowed-local-media-path")
    if not resolved.is_file():
        raise ValueError(f"{where}: {path[:256]!r} is not a file under --allowed-local-media-path")
    if resolved.stat().st_size > MAX_MESSAGE_BYTES:
        raise ValueError(f"{where}: {path[:256]!r} is larger than {MAX_MESSAGE_BYTES} bytes")
    return resolved.read_bytes()


def load_image_input(image, where: str, allowed_root: str, max_pixels: int):
    """An ImageInput as a PIL image (RGB); ValueError naming `where` for a wrong MIME type, data that is not that
    type's image, a truncated or corrupt image, or more than max_pixels pixels (checked before decoding)."""
    from PIL import Image

    mime = image.mime_type
    if mime not in IMAGE_MIME_TYPES:
        raise ValueError(
            f"{where}.mime_type: {mime[:64]!r} is not an image type; supported: {', '.join(IMAGE_MIME_TYPES)}"
        )
    source = image.WhichOneof("source")
    if source is None:
        raise ValueError(f"{where}: set data (the image's bytes) or path")
    data = image.data if source == "data" else read_local_media(image.path, f"{where}.path", allowed_root)
    try:
        header = Image.open(io.BytesIO(data))  # reads the header alone
    except (Image.UnidentifiedImageError, Image.DecompressionBombError, OSError) as e:
        raise ValueError(f"{where}: not a readable image ({e})") from None
    if Image.MIME.get(header.format) != mime:
        raise ValueError(f"{where}.mime_type: {mime!r}, but the data is a {header.format} image")
    width, height = header.size
    if width * height > max_pixels:
        raise ValueError(
            f"{where}: {width}x{height} = {width * height} pixels, more than max_image_pixels={max_pixels}"
        )
    return load_image_bytes(data, where)


class VisionPreprocessor:
    """The tokenizer's half of a vision-language model: images in, token ids and MultiModalInputs out."""

    def __init__(self, model_dir, arch_config, media):
        """media: the tokenizer's MediaConfig."""
        info = image_info(arch_config)
        if info is None:
            raise ValueError(f"images: the model ({arch_config.architecture}) takes no images (it is text-only)")
        # The encoder's budgets are the engine's to check (it knows them); the front end checks what it decodes.
        self.limits = MultiModalLimits(media.limit_mm_per_prompt, media.max_image_pixels, 2**31, 2**31)
        self.processor = MultiModalProcessor(model_dir, info, self.limits)
        self.allowed_local_media_path = media.allowed_local_media_path

    def __call__(self, prompt: str, images: list[tuple[str, object]], field: str):
        """(token ids, MultiModalInputs) of a prompt and its images, each given as (its field, ImageInput);
        ValueError names the field of the image at fault, or `field` for them all."""
        if len(images) > self.limits.limit_mm_per_prompt:
            raise ValueError(
                f"{field}: {len(images)} images, more than limit_mm_per_prompt={self.limits.limit_mm_per_prompt}"
            )
        wheres = [where for where, _ in images]
        pil = [
            load_image_input(image, where, self.allowed_local_media_path, self.limits.max_image_pixels)
            for where, image in images
        ]
        try:
            token_ids, features = self.processor(prompt, None, pil)
        except ValueError as e:
            message = _OFFLINE_ITEM.sub(lambda m: wheres[int(m.group(1))], str(e))
            raise ValueError(message.replace("multi_modal_data.image", field)) from None
        return token_ids, mm_features_to_llmmesh(features)
