"""The offline API, following vllm.LLM: generate() and chat() over an in-process EngineCore."""

import itertools
import time
from collections.abc import Sequence

from tqdm import tqdm

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.models.loader import DEFAULT_MODEL, load_tokenizer
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request import EngineCoreEventType, Request, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.engine = EngineCore(EngineArgs(model=model, **engine_args))
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    # ---- generate --------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings, token-id lists, or {"prompt": ...} / {"prompt_token_ids": ...} dicts."""
        prompts = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries, expected one per prompt ({len(prompts)}).")
        texts, token_lists = zip(*(self._tokenize(p) for p in prompts)) if prompts else ((), ())
        # Check every prompt before adding any, so a bad one leaves the engine untouched.
        for token_ids in token_lists:
            self.engine.validate_prompt(token_ids)

        states: dict[str, _RequestState] = {}
        now = time.monotonic()
        for i, (text, token_ids, sp) in enumerate(zip(texts, token_lists, params)):
            request_id = str(next(self._counter))
            request = Request(request_id, token_ids, sp, arrival_time=now, priority=priority[i] if priority else 0)
            self.engine.add_request(request)
            states[request_id] = _RequestState(i, text, token_ids, RequestMetrics(arrival_time=now))
        return self._run_engine(states, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            # The template already holds the special tokens.
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

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
    def _as_params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"Got {len(sampling_params)} sampling_params for {n} prompts; pass one or one per prompt.")
        return sampling_params

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
            raise ValueError("A prompt dict needs a 'prompt' or 'prompt_token_ids' key.")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    def _run_engine(self, states: dict[str, "_RequestState"], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(states)
        bar = tqdm(total=len(states), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    state = states[out.request_id]
                    state.update(out)
                    if out.finished:
                        results[state.index] = state.to_output(out.request_id, self.tokenizer)
                        bar.update(1)
        finally:
            bar.close()
            # If anything went wrong mid-run, leave no request behind in the engine.
            unfinished = [rid for rid, s in states.items() if results[s.index] is None]
            if unfinished:
                self.engine.abort_requests(unfinished)
                self.engine.step()
        return results


class _RequestState:
    def __init__(self, index: int, prompt: str | None, prompt_token_ids: list[int], metrics: RequestMetrics):
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.metrics = metrics
        self.token_ids: list[int] = []
        self.finish_reason = None
        self.stop_reason = None
        self.num_cached_tokens = 0

    def update(self, out) -> None:
        now = time.monotonic()
        m = self.metrics
        for event in out.events:
            if event.type == EngineCoreEventType.SCHEDULED and m.first_scheduled_time is None:
                m.first_scheduled_time = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                m.num_preemptions += 1
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            self.token_ids.extend(out.new_token_ids)
            m.num_generation_tokens = len(self.token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            m.finished_time = now
            self.finish_reason, self.stop_reason = str(out.finish_reason), out.stop_reason

    def to_output(self, request_id: str, tokenizer) -> RequestOutput:
        text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        completion = CompletionOutput(0, text, self.token_ids, None, None, self.finish_reason, self.stop_reason)
        return RequestOutput(
            request_id, self.prompt, self.prompt_token_ids, [completion], True, self.metrics, self.num_cached_tokens
        )
