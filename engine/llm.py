"""The offline API, following vllm.LLM: generate() and chat() over an in-process EngineCore, and embed() with
--runner pooling."""

import time
from collections.abc import Sequence

from tqdm import tqdm

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.lora.request import LoRARequest
from engine.models.loader import DEFAULT_MODEL
from engine.multimodal.media import parse_chat_images
from engine.multimodal.processing import MultiModalProcessor
from engine.output_processor import OutputProcessor
from engine.outputs import EmbeddingRequestOutput, RequestOutput
from engine.pooling.params import PoolingParams
from engine.processor import Processor
from engine.request import SamplingParams
from engine.text.tokenizer import Tokenizer

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.engine = EngineCore(EngineArgs(model=model, **engine_args))
        self.tokenizer = Tokenizer.from_pretrained(self.engine.model_dir)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.processor = Processor.for_engine(self.engine, tokenizer=self.tokenizer)
        # A vision-language model's Hugging Face processor, for prompts with images; None for a text-only model.
        self.mm_processor = (
            None
            if self.engine.mm_info is None
            else MultiModalProcessor(self.engine.model_dir, self.engine.mm_info, self.engine.mm_limits)
        )
        self._num_requests = 0  # request ids so far: the next is str(_num_requests)

    def get_tokenizer(self):
        """The Hugging Face tokenizer, as vllm.LLM returns it."""
        return self.tokenizer.hf

    def reset_prefix_cache(self) -> bool:
        reset = self.engine.reset_prefix_cache()
        self._publish_kv_events()  # AllBlocksCleared
        return reset

    def _publish_kv_events(self) -> None:
        """With a ZMQ publisher (--kv-events-config), hand it the events since the last step; without one they stay
        for the caller's take_kv_events."""
        if self.engine.kv_event_publisher is not None:
            self.engine.take_kv_events()

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter; ValueError says what is wrong with it. False if it was loaded already."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id_or_name: int | str) -> bool:
        """Unload an adapter by id or name; False if none such is loaded."""
        return self.engine.remove_lora(lora_int_id_or_name)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    @property
    def lora_registry(self) -> dict[str, LoRARequest]:
        """The loaded adapters (--lora-modules' too) by name."""
        return dict(self.engine.lora_registry)

    # ---- generate --------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings, token-id lists, or {"prompt": ...} / {"prompt_token_ids": ...} dicts, which may
        carry images as vLLM's {"multi_modal_data": {"image": <PIL image or list>}} (a text prompt names each with
        the model's image token, which the processor expands). lora_request:
        one adapter for all prompts or one per prompt (None: the base model); one not loaded yet is loaded first,
        as vLLM does."""
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompts), SamplingParams)
        return self._run(prompts, params, use_tqdm, priority, lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (an engine with --runner pooling): its prompt runs once, and its hidden states
        are pooled as the engine's pooler config says."""
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(pooling_params, len(prompts), PoolingParams)
        return [EmbeddingRequestOutput.from_base(o) for o in self._run(prompts, params, use_tqdm, None, lora_request)]

    def _run(self, prompts, params, use_tqdm: bool, priority, lora_request) -> list:
        """Admit every prompt with its params (SamplingParams or PoolingParams), then step until all are done."""
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries, expected one per prompt ({len(prompts)}).")
        loras = self._as_lora_list(lora_request, len(prompts))
        # Check and build every request before adding any, so a bad one leaves the engine untouched.
        now, built = time.monotonic(), []
        for i, (prompt, sp, lora) in enumerate(zip(prompts, params, loras)):
            text, token_ids, mm_features = self._tokenize(prompt)
            request_id = str(self._num_requests + i)
            requests = self.processor.process_inputs(
                request_id, token_ids, sp, now, priority[i] if priority else 0, lora_request=lora,
                mm_features=mm_features,
            )  # fmt: skip
            built.append((request_id, text, requests))
        self._num_requests += len(prompts)

        index: dict[str, int] = {}
        for i, ((request_id, text, requests), sp) in enumerate(zip(built, params)):
            index[request_id] = i
            sp = requests[0].sampling_params if requests[0].pooling_params else sp  # a pooling request samples nothing
            self.output_processor.add_request(
                request_id, text, requests[0].prompt_token_ids, sp, now, engine_requests=requests
            )
            for request in requests:
                self.engine.add_request(request)
        return self._run_engine(index, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template. Content may
        be OpenAI-style parts: text, and image_url with a data: URL (nothing is fetched)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            conversation, images = parse_chat_images(conversation)
            text = self.tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt
            )
            if images:  # the processor expands the template's image tokens
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
                continue
            # The template already holds the special tokens.
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ---- helpers ---------------------------------------------------------------

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # a single prompt given as token ids
        return prompts

    @staticmethod
    def _as_params_list(params, n: int, cls: type) -> list:
        """One cls (SamplingParams or PoolingParams) per prompt, from None (the defaults), one, or one per prompt."""
        if params is None:
            return [cls() for _ in range(n)]
        if isinstance(params, cls):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"Got {len(params)} {cls.__name__} for {n} prompts; pass one or one per prompt.")
        return params

    def _as_lora_list(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One per prompt; adapters not loaded yet are loaded (and checked) now."""
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * n
        if len(loras) != n:
            raise ValueError(f"Got {len(loras)} lora_request entries for {n} prompts; pass one or one per prompt.")
        for lora in loras:
            if lora is not None and lora.lora_name not in self.engine.lora_registry:
                self.add_lora(lora)
        return loras

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], list]:
        """The prompt's text, token ids and images (engine.multimodal.inputs.MultiModalFeatureSpec)."""
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data:
            return self._process_images(prompt, mm_data)
        return (*self._tokenize_text(prompt), [])

    def _process_images(self, prompt: dict, mm_data: dict) -> tuple[str | None, list[int], list]:
        if self.mm_processor is None:
            raise ValueError("multi_modal_data.image: the model takes no images (it is text-only).")
        unknown = sorted(set(mm_data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: modalities {unknown} are not supported; image is.")
        images = mm_data["image"]
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        token_ids = prompt.get("prompt_token_ids")
        if token_ids is None and "prompt" not in prompt:
            raise ValueError("A prompt dict needs a 'prompt' or 'prompt_token_ids' key.")
        token_ids, features = self.mm_processor(prompt.get("prompt"), token_ids, images)
        return prompt.get("prompt"), token_ids, features

    def _tokenize_text(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, token_ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            else:
                raise ValueError("A prompt dict needs a 'prompt' or 'prompt_token_ids' key.")
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")
        return text, token_ids

    def _run_engine(self, index: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(index)
        bar = tqdm(total=len(index), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while any(r is None for r in results) and self.engine.has_unfinished_requests():
                finished, reqs_to_abort = self.output_processor.process_outputs(self.engine.step())
                # A stop string ended these: free their blocks before the next step.
                self.engine.abort_requests(reqs_to_abort)
                self._publish_kv_events()
                for output in finished:
                    results[index[output.request_id]] = output
                    bar.update(1)
        finally:
            bar.close()
            # If anything went wrong mid-run, leave no request behind in the engine.
            unfinished = [rid for rid, i in index.items() if results[i] is None]
            if unfinished:
                self.engine.abort_requests(self.output_processor.abort_requests(unfinished))
        return results
