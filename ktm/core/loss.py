"""Targets and the loss on them: what a ``KTMModel`` (``model``, passed in) is trained and
scored on.

The loss covers the target tokens only, and the LM head runs only at the positions that
predict them (``target_logits``). In eval mode ``loss`` reads the targets' log-probs from the
model's runtime (torch, llama.cpp or vLLM: R, likelihoods, perplexity); training, hidden
states and ``target_logits`` stay on torch. ``KTMModel.forward`` is ``loss``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ktm.core.batch import CompressedPrompt, LossOutput, TargetLogits, check_positions, pack
from ktm.core.prompt import PromptLike, Segment
from ktm.errors import KTMError

Target = str | Sequence[int]


def ids_tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def target_ids(model, target: Target, tokenize: Callable | None = None) -> list[int]:
    """Token ids the loss covers: a string is tokenized and gets EOS (the config's
    ``add_eos``); ids given directly (a window cut from a longer text) are used as they are.
    ``tokenize``: in place of ``model.tokenize`` (the same tokenizer's copy on another thread)."""
    if not isinstance(target, str):
        ids = _id_list(model, target)
        if not ids:
            raise KTMError("target token ids are empty: expected at least one id")
        return ids
    ids = (tokenize or model.tokenize)(target)
    if model.config.add_eos and model.eos_id is not None:
        ids = ids + [model.eos_id]
    if not ids:
        raise KTMError(f"target {target!r} tokenizes to nothing: expected a non-empty target")
    return ids


def _id_list(model, target) -> list[int]:
    rows = model.input_embedding.weight.shape[0]
    try:
        ids = [operator.index(i) for i in target]
    except TypeError:
        raise KTMError(f"target must be a str or a sequence of token ids, got "
                       f"{type(target).__name__} {target!r:.60}") from None
    bad = next((i for i in ids if not 0 <= i < rows), None)
    if bad is not None:
        raise KTMError(f"target token id {bad} is outside the vocabulary: expected ids in "
                       f"[0, {rows})")
    return ids


def check_fits(model, prefixes: list[CompressedPrompt], extra: list[int], what: str,
               unread: int = 0) -> None:
    """Each prefix plus its ``extra`` tokens within the model's positions (``check_positions``)."""
    check_positions(prefixes, extra, model.max_positions, model.k, what, unread)


def pairs(model, prompts: Sequence[PromptLike], targets: Sequence[Target], merge: bool = True,
          prefixes: list[CompressedPrompt] | None = None
          ) -> tuple[list[CompressedPrompt], list[list[int]]]:
    """Checked (prompt, target) pairs: each prompt's prefix (``prefixes`` when the caller
    already has them) and its target's ids."""
    single = next((x for x in (prompts, targets) if isinstance(x, (str, Segment))), None)
    if single is not None:  # a str would be read as one prompt (or target) per character
        raise KTMError("expected a list of prompts and a list of targets, one each, got a "
                       f"single {type(single).__name__} {single!r:.40}: wrap it in a list")
    if len(prompts) != len(targets):
        raise KTMError(f"{len(prompts)} prompts but {len(targets)} targets: expected equal")
    if not prompts:
        raise KTMError("no prompts given: expected at least one prompt and its target")
    if prefixes is None:
        prefixes = model.encode_prompts(prompts, merge)
    elif len(prefixes) != len(prompts):
        raise KTMError(f"{len(prefixes)} prefixes for {len(prompts)} prompts: "
                       "expected one each")
    tgt = [target_ids(model, t) for t in targets]
    check_fits(model, prefixes, [len(t) for t in tgt], "target tokens")
    return prefixes, tgt


def target_logits(model, prompts: Sequence[PromptLike], targets: Sequence[Target],
                  merge: bool = True, prefixes: list[CompressedPrompt] | None = None,
                  hidden: bool = False, prompt_hidden: bool = False) -> TargetLogits:
    """fp32 logits (N, V) predicting each target token, N = all target tokens of the batch.

    ``hidden``: also each layer's hidden states (N, D) at those positions (distillation).
    ``prompt_hidden``: also each layer's hidden states (M, D) at every prefix position,
    M = all prefix positions of the batch, row by row (context alignment).
    """
    prefixes, tgt = pairs(model, prompts, targets, merge, prefixes)
    device, embed = model.device, model.input_embedding
    seqs = [torch.cat([cp.embeds, embed(ids_tensor(t, device))]) for cp, t in zip(prefixes, tgt)]
    p = pack(seqs, [cp.row_positions(len(t)) for cp, t in zip(prefixes, tgt)],
             [cp.merged_rows for cp in prefixes])
    longest = p.embeds.shape[1]
    keep = torch.zeros(len(seqs), longest, dtype=torch.bool, device=device)
    in_prompt = torch.zeros_like(keep)
    rows, labels = [], []
    for i, (cp, t) in enumerate(zip(prefixes, tgt)):
        first = longest - p.lengths[i]
        start = first + cp.tokens_out - 1  # hidden state predicting t[0]
        keep[i, start:start + len(t)] = True
        in_prompt[i, first:first + cp.tokens_out] = True
        rows += [i] * len(t)
        labels += t
    deep = hidden or prompt_hidden
    out = model.lm(p.embeds, p.mask, p.position_ids, keep=keep, hidden=deep, gate=p.gate)
    logits, states = out if deep else (out, None)
    return TargetLogits(logits.float(), ids_tensor(labels, device), ids_tensor(rows, device),
                        [len(t) for t in tgt], sum(cp.tokens_in for cp in prefixes),
                        sum(cp.tokens_out for cp in prefixes),
                        tuple(h[keep] for h in states[1:]) if hidden else None,
                        tuple(h[in_prompt] for h in states[1:]) if prompt_hidden else None)


def loss(model, prompts: Sequence[PromptLike], targets: Sequence[Target], merge: bool = True,
         prefixes: list[CompressedPrompt] | None = None) -> LossOutput:
    """Mean NLL of the target tokens, and each row's sum; in eval mode read from the model's
    runtime (its log-probs), in training mode on torch with the autograd graph."""
    if not model.training:
        return _runtime_loss(model, prompts, targets, merge, prefixes)
    t = target_logits(model, prompts, targets, merge, prefixes)
    tok_nll = nn.functional.cross_entropy(t.logits, t.labels, reduction="none")
    nll = tok_nll.new_zeros(len(t.lengths)).index_add(0, t.rows, tok_nll)
    n_tokens = torch.tensor(t.lengths, device=model.device)
    return LossOutput(tok_nll.mean(), nll, n_tokens, t.tokens_in, t.tokens_out)


def _runtime_loss(model, prompts, targets, merge: bool, prefixes) -> LossOutput:
    prefixes, tgt = pairs(model, prompts, targets, merge, prefixes)
    device = model.device
    tok_nll = -torch.cat(model.runtime.score(prefixes, tgt)).to(device, torch.float32)
    rows = torch.tensor([r for r, t in enumerate(tgt) for _ in t], device=device)
    nll = tok_nll.new_zeros(len(tgt)).index_add(0, rows, tok_nll)
    return LossOutput(tok_nll.mean(), nll, torch.tensor([len(t) for t in tgt], device=device),
                      sum(cp.tokens_in for cp in prefixes), sum(cp.tokens_out for cp in prefixes))
