"""Generation: prefill the compressed prefix once, then decode token by token with the KV cache.

``decode_steps`` is the single loop every entry point uses; it yields one token per row and step,
so streaming, batching and future variants (e.g. merging generated tokens) hook in at one place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ktm.errors import KTMError
from ktm.prompt import PromptLike, Segment, split_prompts


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True
    use_cache: bool = True  # False re-runs the whole sequence each step (reference for tests)
    merge: bool = True  # False feeds every segment as plain tokens (the uncompressed baseline)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise KTMError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise KTMError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KTMError(f"top_p must be in (0, 1], got {self.top_p}")


def _select(logits: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator | None):
    """(B, V) logits -> (B,) next tokens, greedy or temperature/top-p sampling."""
    if not cfg.do_sample:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always survives)
        drop = sorted_p.cumsum(-1) - sorted_p >= cfg.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def decode_steps(model, prompts: list[tuple[Segment, ...]], cfg: GenerationConfig,
                 prefixes=None) -> Iterator[torch.Tensor]:
    """Yield (B,) token ids per step; rows that have finished repeat the pad id.

    ``prefixes``: the prompts' ``CompressedPrompt``s when the caller already has them.
    """
    was_training = model.training
    model.eval()  # never decode with dropout on
    try:
        yield from _decode(model, prompts, cfg, prefixes)
    finally:
        model.train(was_training)


def _decode(model, prompts: list[tuple[Segment, ...]], cfg: GenerationConfig, prefixes
            ) -> Iterator[torch.Tensor]:
    if prefixes is None:
        prefixes = model.encode_prompts(prompts, cfg.merge)
    elif len(prefixes) != len(prompts):
        raise KTMError(f"{len(prefixes)} prefixes for {len(prompts)} prompts: expected one each")
    p = model.pack([cp.embeds for cp in prefixes])
    embeds, mask, pos = p.embeds, p.mask, p.position_ids
    cache = DynamicCache(config=model.peft.get_base_model().config) if cfg.use_cache else None
    gen = None
    if cfg.do_sample and cfg.seed is not None:
        gen = torch.Generator(device=model.device).manual_seed(cfg.seed)
    eos, pad = model.tokenizer.eos_token_id, model.tokenizer.pad_token_id
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=model.device)
    h = model.hidden(embeds, mask, pos, cache)
    for _ in range(cfg.max_new_tokens):
        nxt = _select(model.logits(h[:, -1]), cfg, gen)
        nxt = nxt.masked_fill(finished, pad if pad is not None else 0)
        yield nxt
        if cfg.stop_at_eos and eos is not None:
            finished |= nxt == eos
            if bool(finished.all()):
                return
        step = model.embed_ids(nxt)[:, None]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        last = pos[:, -1:] + 1
        if cache is not None:
            pos = last
            h = model.hidden(step, mask, pos, cache)
        else:
            embeds = torch.cat([embeds, step], dim=1)
            pos = torch.cat([pos, last], dim=1)
            h = model.hidden(embeds, mask, pos)


def _trim(ids: list[int], eos: int | None, stop: bool) -> list[int]:
    if stop and eos is not None and eos in ids:
        return ids[: ids.index(eos)]
    return ids


def generate_ids(model, prompts, prefixes=None, **kwargs) -> list[list[int]]:
    """Generated token ids per prompt, EOS and anything after it removed."""
    cfg = GenerationConfig(**kwargs)
    segs, _ = split_prompts(prompts)
    steps = list(decode_steps(model, segs, cfg, prefixes))
    if not steps:
        return [[] for _ in segs]
    ids = torch.stack(steps, dim=1).tolist()
    return [_trim(row, model.tokenizer.eos_token_id, cfg.stop_at_eos) for row in ids]


def generate(model, prompts: PromptLike | Sequence[PromptLike], **kwargs) -> str | list[str]:
    """Text for one prompt (returns str) or a list of prompts (returns list[str])."""
    _, single = split_prompts(prompts)
    rows = generate_ids(model, prompts, **kwargs)
    texts = [model.tokenizer.decode(r, skip_special_tokens=True) for r in rows]
    return texts[0] if single else texts


def stream(model, prompt: PromptLike, **kwargs) -> Iterator[str]:
    """Yield text pieces of one prompt's continuation as tokens are decoded."""
    cfg = GenerationConfig(**kwargs)
    segs, single = split_prompts(prompt)
    if not single:
        raise KTMError("stream takes one prompt; use generate for a list")
    eos, ids, shown = model.tokenizer.eos_token_id, [], ""
    for nxt in decode_steps(model, segs, cfg):
        tok = int(nxt[0])
        if cfg.stop_at_eos and tok == eos:
            break
        ids.append(tok)
        text = model.tokenizer.decode(ids, skip_special_tokens=True)
        # hold back a piece that ends inside a multi-byte character
        if text.endswith("\ufffd"):
            continue
        if len(text) > len(shown):
            yield text[len(shown):]
            shown = text
