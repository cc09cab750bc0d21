"""benchmarks/vllm_peer.py's rounds, on stand-in systems (no vLLM needed): every system gets the same requests in the
same order, no two of a round's prompts share a prefix, and the systems' order rotates from round to round."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import vllm_peer

VOCAB = 1000


class Recorder:
    """A system that records every call and answers with fixed timings and its own first tokens."""

    def __init__(self, name: str, log: list):
        self.name, self.calls, self.log = name, [], log

    def generate(self, prompts, max_tokens):
        self.calls.append(("generate", prompts, max_tokens))
        self.log.append(self.name)
        return 2.0, [[p[0]] for p in prompts]

    def batch(self, prompts, output_len):
        self.calls.append(("batch", prompts, output_len))
        return 0.5, 1.0


def args(**overrides) -> argparse.Namespace:
    base = dict(
        seed=3, rounds=3, num_prompts=6, input_len=(40, 60), output_len=(2, 5), batch_input_len=48,
        batch_output_len=5, ttft_len=80,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **overrides})


def test_every_system_gets_the_same_calls_and_the_order_rotates():
    log = []
    systems = [Recorder(name, log) for name in ("llmmesh", "vllm", "vllm-tuned")]
    higher, runs, same_first = vllm_peer.measure(systems, args(), [1, 4], VOCAB)

    assert systems[0].calls == systems[1].calls == systems[2].calls
    assert [c[0] for c in systems[0].calls] == ["generate", "batch", "batch", "batch"] * 3
    # Each round, the order of the systems moves a place.
    assert log == ["llmmesh", "vllm", "vllm-tuned", "vllm", "vllm-tuned", "llmmesh", "vllm-tuned", "llmmesh", "vllm"]
    assert same_first == {"vllm": [6, 6, 6], "vllm-tuned": [6, 6, 6]}
    assert list(higher.values()) == [True, True, True, False]
    assert runs["decode 4x48+5 (tok/s)", "vllm"] == [16.0] * 3  # 4 requests x 4 decode tokens / 1 s


def test_a_rounds_prompts_share_no_prefix():
    a = args()
    inputs = vllm_peer.round_inputs(a.seed, a, [1, 16], VOCAB)
    prompts = inputs["throughput"][0] + inputs["batches"][1] + inputs["batches"][16] + inputs["ttft"]
    assert len(inputs["ttft"][0]) == 80 and all(len(p) == 48 for p in inputs["batches"][16])
    # No block-sized prefix (16 tokens) repeats, so no prompt hits another's prefix cache.
    assert len({tuple(p[:16]) for p in prompts}) == len(prompts)
    # The next round's are new too; the same seed gives the same inputs.
    later = vllm_peer.round_inputs(a.seed + 1, a, [1, 16], VOCAB)
    assert not {tuple(p[:16]) for p in prompts} & {tuple(p[:16]) for p in later["batches"][16] + later["ttft"]}
    assert vllm_peer.round_inputs(a.seed, a, [1, 16], VOCAB) == inputs


def test_the_table_puts_the_engine_ahead_above_one_for_speeds_and_times_alike():
    higher = {"throughput (out tok/s)": True, "TTFT at 80 tokens (s)": False}
    runs = {
        ("throughput (out tok/s)", "llmmesh"): [90.0, 100.0, 300.0],
        ("throughput (out tok/s)", "vllm"): [50.0, 40.0, 60.0],
        ("TTFT at 80 tokens (s)", "llmmesh"): [1.0, 2.0, 3.0],
        ("TTFT at 80 tokens (s)", "vllm"): [4.0, 5.0, 6.0],
    }
    speed, ttft = vllm_peer.median_table(["llmmesh", "vllm"], runs, higher)
    assert (speed["llmmesh"], speed["vllm"], speed["llmmesh / vllm"]) == (100.0, 50.0, 2.0)
    assert (ttft["llmmesh"], ttft["vllm"], ttft["llmmesh / vllm"]) == (2.0, 5.0, 2.5)
