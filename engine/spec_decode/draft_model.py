"""Draft-model proposer: a second, smaller model with the target's vocabulary proposes the drafts.

Its KV cache has the target's blocks: the same block ids, so the scheduler's block tables (and the step's
attention metadata) serve both; with several KV cache groups, the first group's (full attention where the target
has any: the worker refuses a draft whose layers need more context than that group keeps). Every step it runs over
the target's whole flat batch (prompt chunks and verified drafts alike), so its cache follows the target's; KV
written for rejected drafts is overwritten later, as the target's is. After the rejection sampler, k single-token passes propose k drafts per request, into the lookahead
slots the scheduler reserved. A draft is drawn from the draft's distribution q at the request's temperature (its
argmax for a greedy request), and q travels with the draft to the rejection sampler.

Blocks filled by a KV connector's load hold the target's KV only: drafts over them are poorer (never wrong).
"""

import logging

import torch

from engine.attention.backend import AttentionMetadata, layer_metadata
from engine.config import EngineConfig
from engine.models.files import load_config
from engine.models.linear import process_weights_after_loading
from engine.models.loader import load_weights, prepare_model_dir
from engine.models.registry import ModelRegistry
from engine.sample.ops import random_sample
from engine.sample.rejection_sampler import DraftTokens
from engine.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("llmmesh.engine")

# A seeded request's drafts come from a generator seeded with its seed plus this.
DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15 >> 2


class DraftModelProposer:
    def __init__(
        self,
        config: SpeculativeConfig,
        target_vocab_size: int,
        engine_config: EngineConfig,
        device,
        dtype,
        attn_backend,
    ):
        self.k = config.num_speculative_tokens
        self.device, self.dtype, self.block_size = device, dtype, engine_config.cache_config.block_size
        self.attn_backend = attn_backend
        model_dir = prepare_model_dir(config.model, engine_config.model_config.download_dir)
        self.config = cfg = load_config(model_dir)
        if cfg.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft model's vocabulary ({cfg.vocab_size} tokens) must be the "
                f"target's ({target_vocab_size} tokens): drafts are the target's token ids."
            )
        with torch.device(device):
            model = ModelRegistry.resolve_model_cls(cfg.architecture)(cfg, attn_backend, cfg.quantization)
        model.load_weights(load_weights(model_dir))
        process_weights_after_loading(model, dtype)
        self.model = model.eval()
        if device.type == "cpu":
            try:
                from kernels.cpu_ops import load

                self.model.use_cpu_ops(load())
            except Exception as e:  # noqa: BLE001 (the layers run on torch ops then)
                logger.warning("The draft model's layers run on torch ops (%s)", e)
        element = torch.tensor([], dtype=dtype).element_size()
        # What one block costs the draft's KV cache: the pool's budget pays for the target's and the draft's.
        self.kv_cache_block_bytes = (
            2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * element
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.probs: dict[str, torch.Tensor] = {}  # request_id -> q of its pending drafts, [drafts, vocab]
        self.generators: dict[str, torch.Generator] = {}  # seeded requests draw their drafts from their own
        logger.info("Draft model %s: %d layers", config.model, cfg.num_hidden_layers)

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past the verified tokens that proposing writes (the drafts' KV but the last one's)."""
        return self.k

    def initialize_kv_cache(self, num_blocks: int) -> None:
        cfg = self.config
        shape = self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.probs.pop(request_id, None)
            self.generators.pop(request_id, None)

    def run_batch(self, input_ids, positions, metadata: AttentionMetadata) -> None:
        """The target's step, through the draft: its KV cache gets the same tokens at the same slots."""
        self.model(input_ids, positions, self._layer_metadata(metadata), self.kv_caches)

    def _layer_metadata(self, metadata: AttentionMetadata) -> list[AttentionMetadata]:
        return layer_metadata(self.attn_backend, [metadata], [0] * self.config.num_hidden_layers)

    def draft_tokens(self, scheduled: list[list[int]], requests: list) -> DraftTokens:
        """The step's drafts with their q rows (a draft cut by the scheduler loses its row)."""
        rows = [self.probs[r.request_id][: len(d)] for r, d in zip(requests, scheduled) if d]
        return DraftTokens(scheduled, torch.cat(rows) if rows else None)

    @torch.inference_mode()
    def propose(self, requests: list, new_token_ids: list[list[int]], so) -> dict[str, list[int]]:
        """k drafts per request after its new tokens: k single-token passes of the draft model, batched."""
        for request in requests:  # drafts not proposed again are not verified again either
            self.probs.pop(request.request_id, None)
        rows = []  # (request, position of its last token, drafts it may have, its block ids)
        for request, new in zip(requests, new_token_ids):
            block_ids = so.block_ids[request.request_id][0]
            position = request.num_tokens + len(new) - 1
            # Every draft but the last writes its KV at the next position: within the reserved blocks.
            room = len(block_ids) * self.block_size - position
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - request.num_output_tokens - len(new))
            if min(self.k, room) > 0:
                rows.append((request, position, min(self.k, room), block_ids, new[-1]))
        if not rows:
            return {}
        rows.sort(key=lambda row: -row[2])  # the rows still drafting are always a prefix
        n = len(rows)
        width = max(len(row[3]) for row in rows)
        table = torch.zeros((n, width), dtype=torch.int64)
        for i, row in enumerate(rows):
            table[i, : len(row[3])] = torch.tensor(row[3])
        positions = torch.tensor([row[1] for row in rows])
        tokens = torch.tensor([row[4] for row in rows])
        temperature = torch.tensor([row[0].sampling_params.temperature for row in rows], dtype=torch.float32)
        greedy = [row[0].sampling_params.greedy for row in rows]
        drafts, probs = [], []
        for step in range(rows[0][2]):
            active = sum(1 for row in rows if row[2] > step)
            hidden = self.model(
                tokens[:active].to(self.device),
                positions[:active].to(self.device),
                self._layer_metadata(self._decode_metadata(table[:active], positions[:active])),
                self.kv_caches,
            )
            logits = self.model.compute_logits(hidden).float()
            q = (logits / temperature[:active].to(self.device).clamp(min=1e-5).unsqueeze(1)).softmax(dim=-1)
            token = self._draw(q, [row[0] for row in rows[:active]], greedy[:active])
            drafts.append(token.tolist())
            probs.append(q)
            tokens, positions = token.cpu(), positions[:active] + 1
            table = table[:active]
        out = {}
        for i, (request, _, m, _, _) in enumerate(rows):
            out[request.request_id] = [drafts[step][i] for step in range(m)]
            self.probs[request.request_id] = torch.stack([probs[step][i] for step in range(m)])
        return out

    def _draw(self, q: torch.Tensor, requests: list, greedy: list[bool]) -> torch.Tensor:
        """Each row's draft from q (the argmax for a greedy request), seeded requests from their own generator."""
        generators = {}
        for i, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is not None and not greedy[i]:
                # Not the seed itself: the sampler's generator for this request has it, and the drafts must be
                # independent of the draws that accept them.
                generators[i] = self.generators.setdefault(
                    request.request_id, torch.Generator(self.device).manual_seed(seed + DRAFT_SEED_OFFSET)
                )
        drawn = random_sample(q, generators)
        greedy_rows = torch.tensor(greedy, device=q.device)
        return torch.where(greedy_rows, q.argmax(dim=-1), drawn)

    def _decode_metadata(self, table: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        """One token per row at these positions, in these blocks."""
        n, bs, dev = len(positions), self.block_size, self.device
        slots = table[torch.arange(n), positions // bs] * bs + positions % bs
        seq_lens = (positions + 1).tolist()
        return AttentionMetadata(
            num_actual_tokens=n,
            slot_mapping=slots.to(dev),
            query_start_loc=torch.arange(n + 1, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            block_table=table.to(dev),
            num_decodes=n,
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=seq_lens,
        )
