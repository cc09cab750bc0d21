"""The checks every image of a request passes before the engine core takes it, and what each vision-language
family's processed images look like: the limits (images per prompt, embedding tokens against the encoder's budget
and cache) and placeholders that match the images. A ValueError names the item. Imports no torch, so every front
end (the gateway and the tokenizer service too) checks with it."""

from dataclasses import dataclass


@dataclass
class MultiModalLimits:
    """The engine config's limits (ModelConfig.limit_mm_per_prompt, max_image_pixels; SchedulerConfig's encoder
    budgets), declared once there."""

    limit_mm_per_prompt: int
    max_image_pixels: int
    max_num_encoder_input_tokens: int
    encoder_cache_size: int


class LlavaImageInfo:
    """LLaVA: each image is pixel_values [1, C, S, S] and becomes (S / patch)^2 embeddings, one more for a CLIP
    tower's class token, one fewer with the "default" strategy (which drops the first)."""

    data_keys = ("pixel_values",)

    def __init__(self, hf_config: dict):
        vision = hf_config["vision_config"]
        self.image_token_id = int(hf_config["image_token_index"])
        self.channels = int(vision.get("num_channels", 3))
        self.image_size = int(vision["image_size"])
        class_token = vision.get("model_type", "clip_vision_model") == "clip_vision_model"
        default = hf_config.get("vision_feature_select_strategy", "default") == "default"
        self.num_tokens = (self.image_size // int(vision["patch_size"])) ** 2 + int(class_token) - int(default)

    def num_embeds(self, data: dict, where: str) -> int:
        shape = tuple(data["pixel_values"].shape)
        expected = (1, self.channels, self.image_size, self.image_size)
        if shape != expected:
            raise ValueError(f"{where}: pixel_values has shape {shape}, expected {expected}.")
        return self.num_tokens

    def split(self, processed: dict, num_images: int) -> list[dict]:
        """The processor's batch of images, one dict each."""
        return [{"pixel_values": processed["pixel_values"][i : i + 1]} for i in range(num_images)]


class Gemma3ImageInfo(LlavaImageInfo):
    """Gemma 3: each image is pixel_values [1, C, S, S] pooled to mm_tokens_per_image embeddings, which the
    language model attends to both ways; one crop an image (pan and scan is not implemented)."""

    def __init__(self, hf_config: dict):
        vision = hf_config["vision_config"]
        self.image_token_id = int(hf_config["image_token_index"])
        self.channels = int(vision.get("num_channels", 3))
        self.image_size = int(vision["image_size"])
        self.num_tokens = int(hf_config["mm_tokens_per_image"])

    def split(self, processed: dict, num_images: int) -> list[dict]:
        if any(processed.get("num_crops", [])):
            raise ValueError("multi_modal_data.image: pan-and-scan crops (do_pan_and_scan) are not implemented.")
        return super().split(processed, num_images)

    def check_chunk_budget(self, max_num_batched_tokens: int, long_prefill_token_threshold: int) -> None:
        """At start-up: an image's placeholders are scheduled in one step, so one step must hold them."""
        for name, limit in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("long_prefill_token_threshold", long_prefill_token_threshold),
        ):
            if 0 < limit < self.num_tokens:
                raise ValueError(
                    f"{name}={limit} is less than an image's {self.num_tokens} placeholder tokens, which this model "
                    "prefills in one step (they attend to each other both ways)."
                )


class Qwen2VLImageInfo:
    """Qwen2-VL and Qwen2.5-VL (dynamic resolution): each image is pixel_values [t * h * w, C * temporal_patch *
    patch^2], one row a patch of its grid image_grid_thw [1, 3] = (t, h, w), and becomes t * h * w / merge^2
    embeddings. The processor's placeholder token is expanded to that many by the front end (expand)."""

    data_keys = ("pixel_values", "image_grid_thw")
    image_token = "<|image_pad|>"

    def __init__(self, hf_config: dict):
        vision = hf_config["vision_config"]
        self.image_token_id = int(hf_config["image_token_id"])
        self.merge = int(vision["spatial_merge_size"])
        self.patch_dim = (
            int(vision["in_channels"]) * int(vision["temporal_patch_size"]) * int(vision["patch_size"]) ** 2
        )

    def num_embeds(self, data: dict, where: str) -> int:
        grid = data["image_grid_thw"]
        if tuple(grid.shape) != (1, 3) or grid.dtype.is_floating_point or bool((grid < 1).any()):
            raise ValueError(f"{where}: image_grid_thw must be one row of 3 positive integers, got {grid.tolist()}.")
        t, h, w = (int(x) for x in grid[0])
        if h % self.merge or w % self.merge:
            raise ValueError(f"{where}: image_grid_thw {[t, h, w]} has a side not divisible by {self.merge}.")
        shape, expected = tuple(data["pixel_values"].shape), (t * h * w, self.patch_dim)
        if shape != expected:
            raise ValueError(f"{where}: pixel_values has shape {shape}, expected {expected} for grid {[t, h, w]}.")
        return t * h * w // self.merge**2

    def split(self, processed: dict, num_images: int) -> list[dict]:
        grids, datas, at = processed["image_grid_thw"], [], 0
        for i in range(num_images):
            rows = int(grids[i].prod())
            datas.append(
                {"pixel_values": processed["pixel_values"][at : at + rows], "image_grid_thw": grids[i : i + 1]}
            )
            at += rows
        return datas


_IMAGE_INFO = {
    "LlavaForConditionalGeneration": LlavaImageInfo,
    "Gemma3ForConditionalGeneration": Gemma3ImageInfo,
    "Qwen2VLForConditionalGeneration": Qwen2VLImageInfo,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLImageInfo,
}


def image_info(model_config):
    """The family's image info for a ModelArchConfig; None for a text-only model."""
    cls = _IMAGE_INFO.get(model_config.architecture)
    return None if cls is None else cls(model_config.hf_config)


def check_mm_features(prompt_token_ids: list[int], features: list, info, limits: MultiModalLimits) -> None:
    """A request's images against the model and the limits: each item's tensors, its embedding count against its
    placeholder range, ranges inside the prompt, in order, not overlapping and all of image tokens, and no image
    token outside them."""
    if not features:
        return
    if info is None:
        raise ValueError("multi_modal_data.image: the model takes no images (it is text-only).")
    if len(features) > limits.limit_mm_per_prompt:
        raise ValueError(
            f"multi_modal_data.image: {len(features)} images, more than limit_mm_per_prompt="
            f"{limits.limit_mm_per_prompt}."
        )
    end, token = 0, info.image_token_id
    for i, feature in enumerate(features):
        where = f"multi_modal_data.image[{i}]"
        missing = [k for k in info.data_keys if k not in feature.data]
        if missing:
            raise ValueError(f"{where}: missing processed tensors {missing}.")
        num_embeds = info.num_embeds(feature.data, where)
        rng = feature.mm_position
        if rng.length != num_embeds:
            raise ValueError(
                f"{where}: its placeholder has {rng.length} tokens, but the image has {num_embeds} embeddings."
            )
        if rng.offset < end or rng.end > len(prompt_token_ids):
            raise ValueError(
                f"{where}: placeholder [{rng.offset}, {rng.end}) is out of order, overlaps another, or lies outside "
                f"the prompt of {len(prompt_token_ids)} tokens."
            )
        if any(t != token for t in prompt_token_ids[rng.offset : rng.end]):
            raise ValueError(
                f"{where}: placeholder [{rng.offset}, {rng.end}) holds tokens other than image token {token}."
            )
        if num_embeds > limits.max_num_encoder_input_tokens or num_embeds > limits.encoder_cache_size:
            raise ValueError(
                f"{where}: {num_embeds} embedding tokens exceed max_num_encoder_input_tokens="
                f"{limits.max_num_encoder_input_tokens} or encoder_cache_size={limits.encoder_cache_size}."
            )
        end = rng.end
    covered = sum(f.mm_position.length for f in features)
    total = sum(1 for t in prompt_token_ids if t == token)
    if total != covered:
        raise ValueError(
            f"multi_modal_data.image: the prompt holds {total} image tokens ({token}) but its "
            f"{len(features)} image(s) take {covered}."
        )
