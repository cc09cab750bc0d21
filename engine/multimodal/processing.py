"""Preprocessing outside the engine core: the model's Hugging Face processor (AutoProcessor) turns a prompt's text
and PIL images into token ids with expanded placeholders and one MultiModalFeatureSpec an image. The offline LLM
runs it; a tokenizer service would run the same, and a router that preprocessed its images sends their tensors,
placeholder ranges and hashes as they are (engine.multimodal.checks checks both the same way)."""

from engine.multimodal.checks import MultiModalLimits
from engine.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, hash_tensors


def assign_placeholders(prompt_token_ids: list[int], lengths: list[int], image_token_id: int) -> list[PlaceholderRange]:
    """Each image's range, in order: the next `length` image tokens, which must be consecutive."""
    positions = [i for i, t in enumerate(prompt_token_ids) if t == image_token_id]
    if len(positions) != sum(lengths):
        raise ValueError(
            f"multi_modal_data.image: the prompt holds {len(positions)} image tokens but its {len(lengths)} "
            f"image(s) take {sum(lengths)}."
        )
    ranges, at = [], 0
    for i, length in enumerate(lengths):
        run = positions[at : at + length]
        if run[-1] - run[0] != length - 1:
            raise ValueError(f"multi_modal_data.image[{i}]: its {length} image tokens are not consecutive.")
        ranges.append(PlaceholderRange(run[0], length))
        at += length
    return ranges


class MultiModalProcessor:
    """The offline path: the model's Hugging Face processor (AutoProcessor, from the model directory alone) turns a
    prompt's text and PIL images into token ids (placeholders expanded) and one MultiModalFeatureSpec an image."""

    def __init__(self, model_dir, info, limits: MultiModalLimits):
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

        if getattr(info, "image_token", None):
            # The family's placeholder is expanded here by each image's grid (as its Hugging Face processor does),
            # so only the image processor and tokenizer are loaded (the processor would need a video processor too).
            self.hf = None
            self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        else:
            self.hf = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
            self.image_processor = self.hf.image_processor
        self.info = info
        self.limits = limits

    def check_images(self, images: list) -> None:
        from PIL import Image

        if len(images) > self.limits.limit_mm_per_prompt:
            raise ValueError(
                f"multi_modal_data.image: {len(images)} images, more than limit_mm_per_prompt="
                f"{self.limits.limit_mm_per_prompt}."
            )
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data.image[{i}] must be a PIL image, got {type(image).__name__}.")
            pixels = image.width * image.height
            if pixels > self.limits.max_image_pixels:
                raise ValueError(
                    f"multi_modal_data.image[{i}]: {image.width}x{image.height} = {pixels} pixels, more than "
                    f"max_image_pixels={self.limits.max_image_pixels}."
                )

    def __call__(self, prompt: str | None, token_ids: list[int] | None, images: list):
        """(token ids, features) of a prompt given as text (its image placeholders expanded by the processor) or
        as token ids whose placeholders are expanded already."""
        self.check_images(images)
        if token_ids is None and self.hf is not None:
            try:
                out = self.hf(text=[prompt], images=images or None, return_tensors="pt")
            except ValueError as e:  # the processor's own check that the prompt names each image
                raise ValueError(f"multi_modal_data.image: {e}") from None
            token_ids = out["input_ids"][0].tolist()
        else:
            out = self.image_processor(images, return_tensors="pt") if images else {}
        datas = self.info.split(out, len(images)) if images else []
        lengths = [self.info.num_embeds(d, f"multi_modal_data.image[{i}]") for i, d in enumerate(datas)]
        if token_ids is None:
            text = expand_image_tokens(prompt, self.info.image_token, lengths)
            token_ids = self.tokenizer(text)["input_ids"]
        if not images:
            return token_ids, []
        ranges = assign_placeholders(token_ids, lengths, self.info.image_token_id)
        return token_ids, [MultiModalFeatureSpec(d, hash_tensors(d), r) for d, r in zip(datas, ranges)]


def expand_image_tokens(prompt: str, image_token: str, lengths: list[int]) -> str:
    """The prompt with its i-th image token repeated lengths[i] times (one token an image before)."""
    parts = prompt.split(image_token)
    if len(parts) - 1 != len(lengths):
        raise ValueError(
            f"multi_modal_data.image: the prompt holds {len(parts) - 1} {image_token} tokens and {len(lengths)} images."
        )
    return parts[0] + "".join(image_token * n + part for n, part in zip(lengths, parts[1:]))
