"""Images from OpenAI-style chat content: image_url parts holding data: URLs (base64), decoded with PIL. Nothing
is fetched: any other URL is refused naming the part."""

import base64
import binascii
import io

# The MIME types a data: URL may carry an image as.
IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp")


def load_image_bytes(data: bytes, where: str):
    """A PIL image (RGB) from encoded bytes; ValueError naming where for a truncated or corrupt image."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"{where}: not a readable image ({e}).") from None
    return image.convert("RGB")


def load_data_url(url: str, where: str):
    """The image of a data:<mime>;base64,<data> URL."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(f"{where}: only data: URLs are accepted (nothing is fetched), got {str(url)[:40]!r}.")
    header, sep, payload = url[5:].partition(",")
    mime, _, encoding = header.partition(";")
    if not sep or encoding != "base64":
        raise ValueError(f"{where}: a data: URL must be data:<mime type>;base64,<data>.")
    if mime not in IMAGE_MIME_TYPES:
        raise ValueError(f"{where}: MIME type {mime!r} is not an image type; supported: {', '.join(IMAGE_MIME_TYPES)}.")
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where}: bad base64 ({e}).") from None
    return load_image_bytes(data, where)


def parse_chat_images(conversation: list[dict]) -> tuple[list[dict], list]:
    """The conversation with each image_url part turned into {"type": "image"} (what chat templates place an image
    token for), and the images in order."""
    messages, images = [], []
    for m, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(load_data_url(url, f"messages[{m}].content[{p}].image_url"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        messages.append({**message, "content": parts})
    return messages, images
