"""KTMModel: a LoRA-adapted causal LM that reads K-merged prompt embeddings.

Layout of every sequence the LM sees (rows left-padded to a common length):

    [pad ...][prefix: merged blocks and plain-token embeddings][targets or generated tokens]

Position ids count only real positions, so a row's result does not depend on its batch-mates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ktm.encoder import EncoderConfig, KTokenEncoder
from ktm.errors import KTMError
from ktm.models import DEFAULT_MODEL, load_base
from ktm.prompt import PromptLike, Segment, as_segments, split_prompts

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSettings:
    r: int = 4
    alpha: int = 16
    dropout: float = 0.05
    # names absent from a model family are dropped; if none match, PEFT's per-family default is used
    target_modules: tuple[str, ...] = LLAMA_TARGETS

    def __post_init__(self) -> None:
        if self.r < 1:
            raise KTMError(f"LoRA r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise KTMError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        self.target_modules = tuple(self.target_modules)


@dataclass
class CompressedPrompt:
    """A prompt's prefix embeddings (L, D) with exact token counts before and after merging."""

    embeds: torch.Tensor
    tokens_in: int
    tokens_out: int

    @property
    def length_reduction(self) -> float:
        return 1.0 - self.tokens_out / self.tokens_in


@dataclass
class LossOutput:
    loss: torch.Tensor  # mean NLL over all target tokens of the batch
    nll: torch.Tensor  # (B,) summed NLL per sample
    n_tokens: torch.Tensor  # (B,) target tokens per sample
    tokens_in: int = 0  # prompt tokens before merging, summed over the batch
    tokens_out: int = 0  # prompt positions the LM actually read
    parts: dict[str, tuple[float, int]] = field(default_factory=dict)  # objective: (sum, tokens)


@dataclass
class TargetLogits:
    """Logits at the target positions of a batch, flattened over samples."""

    logits: torch.Tensor  # (N, V) fp32, N = total target tokens
    labels: torch.Tensor  # (N,) target token ids
    rows: torch.Tensor  # (N,) sample index of each target token
    lengths: list[int]  # target tokens per sample
    tokens_in: int
    tokens_out: int


@dataclass
class Packed:
    """Left-padded batch: embeds (B, L, D), mask (B, L), position_ids (B, L)."""

    embeds: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    lengths: list[int] = field(default_factory=list)


def _lora_config(lm: nn.Module, s: LoraSettings) -> LoraConfig:
    names = {n.rsplit(".", 1)[-1] for n, _ in lm.named_modules()}
    targets = [t for t in s.target_modules if t in names] or None
    return LoraConfig(
        r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=targets,
        task_type="CAUSAL_LM",
    )


class KTMModel(nn.Module):
    """Base causal LM + PEFT LoRA + K-token merging encoder."""

    def __init__(
        self,
        peft_model: PeftModel,
        tokenizer: PreTrainedTokenizerBase,
        encoder: KTokenEncoder,
        base_model: str,
        lora: LoraSettings,
        add_eos: bool = True,
        plain_prefix: int = 0,
    ):
        super().__init__()
        if plain_prefix < 0:
            raise KTMError(f"plain_prefix must be >= 0, got {plain_prefix}")
        self.peft = peft_model
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.base_model = base_model
        self.lora = lora
        self.add_eos = add_eos
        # the first tokens of a prompt stay plain: position 0 is the LM's attention sink
        self.plain_prefix = plain_prefix
        lm: PreTrainedModel = peft_model.get_base_model()
        # views into the PEFT-wrapped LM, kept out of nn.Module registration (no duplicate params)
        object.__setattr__(self, "_body", lm.base_model)  # decoder stack without the LM head
        object.__setattr__(self, "_head", lm.get_output_embeddings())
        object.__setattr__(self, "_embed", lm.get_input_embeddings())
        self._softcap = getattr(lm.config, "final_logit_softcapping", None)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_base(
        cls,
        base: str | PreTrainedModel = DEFAULT_MODEL,
        k: int = 4,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        mlp_ratio: float = 2.0,
        use_mlp: bool = True,
        slot_weights: bool = False,
        mlp_gate: bool = False,
        inner_k: int = 1,
        plain_prefix: int = 0,
        lora: LoraSettings | None = None,
        add_eos: bool = True,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> KTMModel:
        """Wrap a base model (embedded name, local HF folder, or a loaded model + tokenizer)."""
        if isinstance(base, str):
            lm, tok = load_base(base, device, dtype)
            name = base
        else:
            if tokenizer is None:
                raise KTMError("from_base with a model object needs tokenizer=...")
            lm, tok, name = base.to(device=device, dtype=dtype), tokenizer, base.name_or_path
        lora = lora or LoraSettings()
        enc_cfg = EncoderConfig(lm.config.hidden_size, k, mlp_ratio, use_mlp, slot_weights,
                                mlp_gate, inner_k)
        encoder = KTokenEncoder.from_config(enc_cfg).to(device, dtype)
        peft_model = get_peft_model(lm, _lora_config(lm, lora))
        return cls(peft_model, tok, encoder, name, lora, add_eos, plain_prefix).eval()

    def save(self, directory: str) -> None:
        from ktm.checkpoint import save_model

        save_model(self, directory)

    @classmethod
    def load(
        cls,
        directory: str,
        *,
        base: str | None = None,
        k: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        trainable: bool = False,
    ) -> KTMModel:
        from ktm.checkpoint import load_model

        return load_model(directory, base=base, k=k, device=device, dtype=dtype,
                          trainable=trainable)

    # ---------------------------------------------------------------- properties
    @property
    def k(self) -> int:
        return self.encoder.k

    @property
    def merges(self) -> bool:
        """False for K=1 with nothing learnable: merging is the identity and is skipped."""
        return not self.encoder.config.is_identity

    @property
    def device(self) -> torch.device:
        return self._embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embed.weight.dtype

    @property
    def config_dict(self) -> dict:
        cfg = self.peft.get_base_model().config
        return {
            "base_model": self.base_model,
            "encoder": self.encoder.config.to_dict(),
            "lora": {**asdict(self.lora), "target_modules": list(self.lora.target_modules)},
            "add_eos": self.add_eos,
            "plain_prefix": self.plain_prefix,
            "hidden_size": cfg.hidden_size,
            "vocab_size": self._embed.weight.shape[0],
            "model_type": cfg.model_type,
        }

    # ---------------------------------------------------------------- prompts
    def tokenize(self, text: str, first: bool = False) -> list[int]:
        """Token ids of one segment; only the first segment gets the tokenizer's special tokens."""
        return self.tokenizer(text, add_special_tokens=first)["input_ids"]

    def compress(
        self, prompt: PromptLike | Sequence[PromptLike], merge: bool = True
    ) -> CompressedPrompt | list[CompressedPrompt]:
        """Prefix embeddings of one prompt or a list of prompts (``merge=False``: all plain)."""
        prompts, single = split_prompts(prompt)
        out = self.encode_prompts(prompts, merge)
        return out[0] if single else out

    def encode_prompts(
        self, prompts: list[tuple[Segment, ...]], merge: bool = True
    ) -> list[CompressedPrompt]:
        """Normalised prompts -> their LM input embeddings, the encoder run once for all.

        This is the one prompt-encoding step that training, evaluation, generation and the
        benchmark share.
        """
        merge = merge and self.merges
        pieces: list[list[tuple[list[int], bool]]] = []
        for segs in prompts:
            row = [(self.tokenize(s.text, i == 0) if s.ids is None else list(s.ids),
                    merge and s.compress) for i, s in enumerate(segs)]
            if self.plain_prefix and row and row[0][1]:
                ids, n = row[0][0], self.plain_prefix
                row[:1] = [(ids[:n], False), (ids[n:], True)]
            pieces.append(row)
        to_merge = [ids for row in pieces for ids, c in row if c and ids]
        merged = iter(self._merge_segments(to_merge))
        results = []
        for row in pieces:
            parts, n_in = [], 0
            for ids, c in row:
                if not ids:
                    continue
                n_in += len(ids)
                parts.append(next(merged) if c else self._embed(self._ids(ids)))
            if n_in == 0:
                raise KTMError("prompt tokenizes to no tokens: expected a non-empty prompt")
            embeds = torch.cat(parts, dim=0)
            results.append(CompressedPrompt(embeds, n_in, embeds.shape[0]))
        return results

    def _merge_segments(self, segments: list[list[int]]) -> list[torch.Tensor]:
        """Run the encoder once over all compressed segments: right-padded (S, T, D) batch."""
        if not segments:
            return []
        longest = max(len(s) for s in segments)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([s + [pad] * (longest - len(s)) for s in segments], device=self.device)
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in segments],
                            device=self.device, dtype=torch.bool)
        merged, _ = self.encoder(self._embed(ids), mask)
        k = self.encoder.k
        return [merged[i, : -(-len(s) // k)] for i, s in enumerate(segments)]

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids)

    # ---------------------------------------------------------------- the LM
    def pack(self, seqs: list[torch.Tensor]) -> Packed:
        """Left-pad a list of (L_i, D) sequences into one batch."""
        lengths = [s.shape[0] for s in seqs]
        longest = max(lengths)
        b, d = len(seqs), seqs[0].shape[-1]
        embeds = seqs[0].new_zeros(b, longest, d)
        mask = torch.zeros(b, longest, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            embeds[i, longest - s.shape[0]:] = s
            mask[i, longest - s.shape[0]:] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return Packed(embeds, mask, position_ids, lengths)

    def hidden(self, embeds, mask, position_ids, cache=None) -> torch.Tensor:
        """(B, L, D) embeddings -> (B, L, D) last hidden states; extends ``cache`` if given."""
        out = self._body(
            inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
            past_key_values=cache, use_cache=cache is not None,
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on selected hidden states only (full-vocab logits are the costly part)."""
        logits = self._head(hidden)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def prompt_logits(self, prompt: PromptLike, merge: bool = True) -> torch.Tensor:
        """(L, V) logits at every prefix position of one prompt."""
        cp = self.encode_prompts([as_segments(prompt)], merge)[0]
        p = self.pack([cp.embeds])
        return self.logits(self.hidden(p.embeds, p.mask, p.position_ids))[0]

    # ---------------------------------------------------------------- training forward
    def target_ids(self, target: str | Sequence[int]) -> list[int]:
        """Token ids the loss covers: a string is tokenized and gets EOS (``add_eos``); ids given
        directly (a window cut from a longer text) are used exactly as they are."""
        if not isinstance(target, str):
            ids = [int(i) for i in target]
            if not ids:
                raise KTMError("target token ids are empty: expected at least one id")
            return ids
        ids = self.tokenize(target)
        if self.add_eos and self.tokenizer.eos_token_id is not None:
            ids = ids + [self.tokenizer.eos_token_id]
        if not ids:
            raise KTMError(f"target {target!r} tokenizes to nothing: expected a non-empty target")
        return ids

    def forward(
        self, prompts: Sequence[PromptLike], targets: Sequence[str | Sequence[int]],
        merge: bool = True, prefixes: list[CompressedPrompt] | None = None,
    ) -> LossOutput:
        """Loss on target tokens only; logits are computed at labelled positions only.

        ``prefixes``: the prompts' ``CompressedPrompt``s when the caller already has them.
        """
        t = self.target_logits(prompts, targets, merge, prefixes)
        tok_nll = nn.functional.cross_entropy(t.logits, t.labels, reduction="none")
        nll = torch.zeros(len(t.lengths), device=self.device).index_add(0, t.rows, tok_nll)
        n_tokens = torch.tensor(t.lengths, device=self.device)
        return LossOutput(tok_nll.mean(), nll, n_tokens, t.tokens_in, t.tokens_out)

    def target_logits(
        self, prompts: Sequence[PromptLike], targets: Sequence[str | Sequence[int]],
        merge: bool = True, prefixes: list[CompressedPrompt] | None = None,
    ) -> TargetLogits:
        """fp32 logits (N, V) predicting each target token, N = all target tokens of the batch."""
        if len(prompts) != len(targets):
            raise KTMError(f"{len(prompts)} prompts but {len(targets)} targets: expected equal")
        if prefixes is None:
            prefixes = self.encode_prompts([as_segments(p) for p in prompts], merge)
        elif len(prefixes) != len(prompts):
            raise KTMError(f"{len(prefixes)} prefixes for {len(prompts)} prompts: "
                           "expected one each")
        tgt = [self.target_ids(t) for t in targets]
        seqs = [torch.cat([cp.embeds, self._embed(self._ids(t))]) for cp, t in zip(prefixes, tgt)]
        p = self.pack(seqs)
        longest = p.embeds.shape[1]
        rows, cols, labels = [], [], []
        for i, (cp, t) in enumerate(zip(prefixes, tgt)):
            start = longest - p.lengths[i] + cp.tokens_out - 1  # hidden state predicting t[0]
            rows += [i] * len(t)
            cols += range(start, start + len(t))
            labels += t
        h = self.hidden(p.embeds, p.mask, p.position_ids)
        rows_t, cols_t = self._ids(rows), self._ids(cols)
        logits = self.logits(h[rows_t, cols_t]).float()
        return TargetLogits(logits, self._ids(labels), rows_t, [len(t) for t in tgt],
                            sum(cp.tokens_in for cp in prefixes),
                            sum(cp.tokens_out for cp in prefixes))

    # ---------------------------------------------------------------- generation
    def generate(self, prompts, **kwargs):
        """Text continuation(s); see ``ktm.generate.GenerationConfig`` for the options."""
        from ktm.generate import generate

        return generate(self, prompts, **kwargs)

    def stream(self, prompt: PromptLike, **kwargs):
        """Yield text pieces of one prompt's continuation as they are decoded."""
        from ktm.generate import stream

        return stream(self, prompt, **kwargs)

    def add_meta_tokens(self, sequences: Sequence[Sequence[int]]) -> list[int]:
        """Append one trainable input-embedding row per token sequence; returns the new ids.

        Each row starts as the mean embedding of its sequence (LTSC meta-tokens). The rows are
        input-only (the LM head never predicts them) and train alongside LoRA.
        """
        from ktm.compressors.ltsc import MetaEmbedding

        if not sequences or not all(sequences):
            raise KTMError("add_meta_tokens needs non-empty token sequences, got an empty one")
        with torch.no_grad():
            rows = torch.stack([self._embed(self._ids(list(s))).mean(0) for s in sequences])
        old = getattr(self, "meta_embedding", None)
        base = old.base if old is not None else self._embed
        if old is not None:
            rows = torch.cat([old.meta.detach(), rows])
        self.meta_embedding = MetaEmbedding(base, rows)
        object.__setattr__(self, "_embed", self.meta_embedding)
        start = base.weight.shape[0] + rows.shape[0] - len(sequences)
        return list(range(start, start + len(sequences)))

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]
