"""benchmarks/peers.py's correctness checks: greedy streams compared tie-aware against the
transformers reference."""

from __future__ import annotations

import dataclasses
from typing import Any

from peer_setup import Checkpoint

# --- correctness -----------------------------------------------------------------------------


@dataclasses.dataclass
class Verdict:
    agree: int = 0
    tie: int = 0
    real: list[str] = dataclasses.field(default_factory=list)
    """One line per stream that diverged for real."""

    def describe(self) -> str:
        if not (self.agree or self.tie or self.real):
            return "not checked"
        parts = [f"{self.agree} agree"]
        if self.tie:
            parts.append(f"{self.tie} diverge at a tie")
        if self.real:
            parts.append(f"**{len(self.real)} DIVERGE**")
        return ", ".join(parts)


class Reference:
    """The transformers model in fp32, scoring greedy streams teacher-forced."""

    def __init__(self, checkpoint: Checkpoint, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            checkpoint.hf_dir, dtype=torch.float32
        ).eval()

    def logits(self, prompt: list[int], tokens: list[int]) -> Any:
        """[len(tokens), vocab]: row i scores the token after prompt + tokens[:i]."""
        ids = self.torch.tensor([prompt + tokens[:-1]])
        with self.torch.inference_mode():
            out = self.model(ids).logits[0, len(prompt) - 1 :]
        return out.float()


def check_own(logits: Any, tokens: list[int], atol: float) -> tuple[str, str]:
    """Is every token the reference's argmax, or within ``atol`` of it? ('agree'|'tie'|'real')."""
    best = logits.max(dim=-1).values
    import torch

    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    gaps = (best - chosen).tolist()
    for step, gap in enumerate(gaps):
        if gap > atol:
            top = int(logits[step].argmax())
            return "real", f"step {step}: chose {tokens[step]}, reference {top} ({gap:.3g} higher)"
    return ("tie" if any(g > 0 for g in gaps) else "agree"), ""


def check_against(logits: Any, ours: list[int], theirs: list[int], atol: float) -> tuple[str, str]:
    """Compare a peer's stream with Brigade's (scored by ``logits`` of Brigade's stream)."""
    for step, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
        if mine == other:
            continue
        gap = abs(float(logits[step, mine]) - float(logits[step, other]))
        if gap <= atol:
            return "tie", ""
        top = int(logits[step].argmax())
        return "real", (
            f"step {step}: Brigade {mine}, this engine {other}; the reference scores them "
            f"{gap:.3g} apart and prefers {top}"
        )
    if len(ours) != len(theirs):
        return "real", f"lengths differ: {len(ours)} vs {len(theirs)}"
    return "agree", ""


def check_workload(
    reference: Reference,
    workload: dict[str, Any],
    results: dict[str, dict[str, Any]],
    atol: float,
) -> dict[str, Verdict]:
    """Per engine, how its sampled streams compare (Brigade's: with the reference itself)."""
    verdicts = {engine: Verdict() for engine in results}
    prompts = workload["runs"][0]["prompts"]
    for index in workload["sample"]:
        key = str(index)
        streams = {e: r["tokens"][key] for e, r in results.items() if key in r.get("tokens", {})}
        base_engine = "brigade" if "brigade" in streams else None
        base_logits = None
        if base_engine:
            base_logits = reference.logits(prompts[index], streams["brigade"])
        for engine, tokens in streams.items():
            if engine == base_engine or base_logits is None:
                outcome, detail = check_own(reference.logits(prompts[index], tokens), tokens, atol)
            else:
                outcome, detail = check_against(base_logits, streams["brigade"], tokens, atol)
            verdict = verdicts[engine]
            if outcome == "agree":
                verdict.agree += 1
            elif outcome == "tie":
                verdict.tie += 1
            else:
                verdict.real.append(f"request {index}: {detail}")
    return verdicts
