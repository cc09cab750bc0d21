"""A vision-language model's images in the services that preprocess them: the tokenizer (llmmesh.v1.ImageInput:
encoded bytes and their MIME type, or a file under --allowed-local-media-path) and the engine's VllmEngine port (a
router's media references: data: URLs, or file: URLs under --allowed-local-media-path). Images are decoded with
PIL, then run through the model's Hugging Face processor (engine.multimodal.processing.MultiModalProcessor, as the
offline LLM runs it) for the token ids and one MultiModalFeatureSpec an image. Nothing is fetched from the network.
Loads torch, so a service imports this module only for a vision-language model."""

import base64
import binascii
import io
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from engine.multimodal.checks import LlavaImageInfo, MultiModalLimits, Qwen2VLImageInfo, image_info
from engine.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, hash_tensors
from engine.multimodal.media import IMAGE_MIME_TYPES, load_image_bytes
from engine.multimodal.processing import MultiModalProcessor
from mesh.grpc_policy import MAX_MESSAGE_BYTES
from services.convert import mm_features_to_llmmesh

# How the offline processor names an image (multi_modal_data.image[i]); the service names the request's field.
_OFFLINE_ITEM = re.compile(r"multi_modal_data\.image\[(\d+)\]")
_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*);base64,(?P<data>.*)", re.DOTALL)


def read_local_media(path: str, where: str, allowed_root: str) -> bytes:
    """A file's bytes, if its resolved path (symbolic links followed) lies under allowed_root."""
    if not allowed_root:
        raise ValueError(f"{where}: local files are not accepted here (this service has no --allowed-local-media-path)")
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

    mime = image.mime_type
    if mime not in IMAGE_MIME_TYPES:
        raise ValueError(
            f"{where}.mime_type: {mime[:64]!r} is not an image type; supported: {', '.join(IMAGE_MIME_TYPES)}"
        )
    source = image.WhichOneof("source")
    if source is None:
        raise ValueError(f"{where}: set data (the image's bytes) or path")
    data = image.data if source == "data" else read_local_media(image.path, f"{where}.path", allowed_root)
    return decode_image(data, mime, where, f"{where}.mime_type", max_pixels)


def decode_image(data: bytes, mime: str | None, where: str, mime_where: str, max_pixels: int):
    """Encoded bytes as a PIL image (RGB), checked against their MIME type (None: any image type) and max_pixels
    (before decoding); ValueError naming `where` (`mime_where` for the MIME type)."""
    from PIL import Image

    try:
        header = Image.open(io.BytesIO(data))  # reads the header alone
    except (Image.UnidentifiedImageError, Image.DecompressionBombError, OSError) as e:
        raise ValueError(f"{where}: not a readable image ({e})") from None
    if mime is not None and Image.MIME.get(header.format) != mime:
        raise ValueError(f"{mime_where}: {mime!r}, but the data is a {header.format} image")
    if Image.MIME.get(header.format) not in IMAGE_MIME_TYPES:
        raise ValueError(f"{where}: a {header.format} image; supported: {', '.join(IMAGE_MIME_TYPES)}")
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


def load_media_ref(url: str, where: str, allowed_root: str, max_pixels: int):
    """A router's media reference (vLLM's MediaRef.url) as a PIL image: a data:<mime>;base64,<data> URL, or a file:
    URL under allowed_root; ValueError naming `where` for any other URL (nothing is fetched) or a bad image."""
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
        match = _DATA_URL.fullmatch(url)
        if match is None:
            raise ValueError(f"{where}: a data: URL must be data:<mime type>;base64,<data>")
        if match["mime"] not in IMAGE_MIME_TYPES:
            supported = ", ".join(IMAGE_MIME_TYPES)
            raise ValueError(f"{where}: {match['mime'][:64]!r} is not an image type; supported: {supported}")
        try:
            data = base64.b64decode(match["data"], validate=True)
        except binascii.Error as e:
            raise ValueError(f"{where}: bad base64 ({e})") from None
        return decode_image(data, match["mime"], where, where, max_pixels)
    if scheme == "file":
        data = read_local_media(unquote(urlsplit(url).path), where, allowed_root)
        return decode_image(data, None, where, where, max_pixels)
    raise ValueError(
        f"{where}: {scheme[:16]!r} URLs are not fetched (nothing is fetched from the network); send the image as a "
        "data: URL, or a file: URL under --allowed-local-media-path"
    )


def expands_anchors(info) -> bool:
    """Whether a family's prompt names an image with one image token that its processor repeats (LLaVA, Qwen2-VL),
    so that a router's token ids can be expanded here; Gemma 3's processor writes a sequence of its own."""
    return type(info) in (LlavaImageInfo, Qwen2VLImageInfo)


class MediaRefProcessor:
    """The engine's VllmEngine port, for a router that leaves media to the worker (vLLM's media_refs): each image
    is loaded from its URL and run through the model's image processor, and its one placeholder anchor in the
    router's token ids is expanded to the image's embedding count."""

    def __init__(self, model_dir, info, limits: MultiModalLimits, allowed_local_media_path: str):
        self.processor = MultiModalProcessor(model_dir, info, limits)
        self.info, self.limits = info, limits
        self.allowed_local_media_path = allowed_local_media_path

    def __call__(self, token_ids: list[int], urls: list[str], field: str):
        """(token ids, MultiModalFeatureSpecs); ValueError names `field`[i] for the item at fault."""
        if len(urls) > self.limits.limit_mm_per_prompt:
            raise ValueError(
                f"{field}: {len(urls)} images, more than limit_mm_per_prompt={self.limits.limit_mm_per_prompt}"
            )
        images = [
            load_media_ref(url, f"{field}[{i}].url", self.allowed_local_media_path, self.limits.max_image_pixels)
            for i, url in enumerate(urls)
        ]
        token = self.info.image_token_id
        anchors = [i for i, t in enumerate(token_ids) if t == token]
        if len(anchors) != len(images):
            raise ValueError(
                f"{field}: the prompt holds {len(anchors)} image tokens ({token}) for {len(images)} images: give one "
                "unexpanded placeholder an image"
            )
        out = self.processor.image_processor(images, return_tensors="pt")
        datas = self.info.split(out, len(images))
        expanded, features, at = [], [], 0
        for i, (anchor, data) in enumerate(zip(anchors, datas)):
            length = self.info.num_embeds(data, f"{field}[{i}]")
            expanded += token_ids[at:anchor]
            features.append(MultiModalFeatureSpec(data, hash_tensors(data), PlaceholderRange(len(expanded), length)))
            expanded += [token] * length
            at = anchor + 1
        return expanded + token_ids[at:], features
