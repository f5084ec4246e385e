"""The workload of ``verify``: prompts from a fixed passage, logits at the prompt positions, greedy generation.

Prompts are cut from one fixed English passage, so real tokenizers produce realistic, reproducible inputs;
models saved without a tokenizer (the presets) get its UTF-8 bytes as token ids.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

# A fixed English passage: prompts come from it so real tokenizers produce realistic, reproducible inputs.
_PROMPT_TEXT = (
    "The kernel reads each row of the hidden state once, adds the residual, computes the root mean square in "
    "single precision, and writes both the normalised row and the new residual stream back to memory. "
    "Fusing these steps saves one full pass over the activations in every decoder layer, which matters most "
    "when the batch is small and the model spends its time moving data rather than multiplying matrices. "
)


@dataclass
class Prompts:
    """A batch of token ids with its attention mask (0 marks left padding)."""

    input_ids: Tensor
    attention_mask: Tensor

    @property
    def position_ids(self) -> Tensor:
        """Positions counted from each row's first real token, so a padded row matches its unpadded self."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)


def pad_token_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> int:
    """The id used for left padding: the tokenizer's or config's pad token, else eos, else 0."""
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        model.config.pad_token_id,
        getattr(tokenizer, "eos_token_id", None),
        model.config.eos_token_id,
    ):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _token_stream(tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer(_PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    else:
        # Byte-level fallback for models saved without a tokenizer (the presets reserve ids 0-255 for it).
        ids = list(_PROMPT_TEXT.encode())
    return [i % vocab_size for i in ids]


def make_prompts(
    tokenizer: PreTrainedTokenizerBase | None,
    vocab_size: int,
    batch_size: int,
    prompt_len: int,
    pad_id: int,
    *,
    left_pad: bool,
    device: torch.device | str = "cpu",
) -> Prompts:
    """Rows of ``prompt_len`` tokens taken at different offsets of a fixed passage.

    With ``left_pad`` the rows get shorter down the batch (the last one about half ``prompt_len``) and are
    left-padded with ``pad_id``, as batched generation does; otherwise every row is full.
    """
    stream = _token_stream(tokenizer, vocab_size)
    ids = torch.full((batch_size, prompt_len), pad_id, dtype=torch.long)
    mask = torch.zeros((batch_size, prompt_len), dtype=torch.long)
    for row in range(batch_size):
        length = max(1, prompt_len - (row * prompt_len) // (2 * batch_size)) if left_pad else prompt_len
        # Repeat the passage as often as needed; offset rows so they differ.
        start = 7 * row
        tokens = [stream[(start + k) % len(stream)] for k in range(length)]
        ids[row, prompt_len - length:] = torch.tensor(tokens)
        mask[row, prompt_len - length:] = 1
    return Prompts(ids.to(device), mask.to(device))


@torch.no_grad()
def prompt_logits(model: PreTrainedModel, prompts: Prompts) -> Tensor:
    """Logits at every real (unpadded) prompt position, ``[positions, vocab]``, in at least fp32."""
    inputs = {"input_ids": prompts.input_ids, "attention_mask": prompts.attention_mask}
    # Models that take positions get them counted from each row's first real token, as generate() does;
    # a few architectures (ALiBi ones) have no position_ids argument.
    if "position_ids" in inspect.signature(model.forward).parameters:
        inputs["position_ids"] = prompts.position_ids
    logits = model(**inputs).logits
    valid = prompts.attention_mask.bool()
    return logits[valid].to(torch.promote_types(logits.dtype, torch.float32))


def generation_config(new_tokens: int, pad_id: int) -> GenerationConfig:
    """Greedy decoding of exactly ``new_tokens`` tokens, ignoring the checkpoint's sampling defaults."""
    return GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id
    )


@torch.no_grad()
def greedy_tokens(model: PreTrainedModel, prompts: Prompts, new_tokens: int, pad_id: int) -> Tensor:
    """The ``[batch, new_tokens]`` tokens greedy ``generate()`` appends to the prompts."""
    out = model.generate(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        generation_config=generation_config(new_tokens, pad_id),
    )
    return out[:, prompts.input_ids.shape[1]:].cpu()
