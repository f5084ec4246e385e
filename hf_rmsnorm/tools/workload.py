"""The workload of ``verify``: prompts, logits at the prompt positions, greedy generation.

Two kinds of prompts:

* chat prompts (``chat_prompts``): a few everyday requests, formatted by the tokenizer's chat template when it
  has one, so a real model sees what its users send and its answers can be read;
* passage prompts (``make_prompts``): rows of a given length cut from one fixed English passage, for the
  speed run (whose length must be controlled) and for models saved without a tokenizer (the random-weight
  presets), which get the passage's UTF-8 bytes as token ids.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import CompileConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

# A fixed English passage: prompts come from it so real tokenizers produce realistic, reproducible inputs.
_PROMPT_TEXT = (
    "The kernel reads each row of the hidden state once, adds the residual, computes the root mean square in "
    "single precision, and writes both the normalised row and the new residual stream back to memory. "
    "Fusing these steps saves one full pass over the activations in every decoder layer, which matters most "
    "when the batch is small and the model spends its time moving data rather than multiplying matrices. "
)


# Everyday requests with short, checkable answers; rows beyond these reuse them.
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "Name three primary colours.",
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
    """The id used for left padding: the tokenizer's or config's pad token, else eos, else 0.

    Ids outside the embedding table are passed over (a config may name a bos/eos the vocabulary lacks, as a
    shrunk GPT-2 config does): padded positions are masked out, so any id in range pads correctly.
    """
    vocab_size = model.get_input_embeddings().weight.shape[0]
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        model.config.pad_token_id,
        getattr(tokenizer, "eos_token_id", None),
        model.config.eos_token_id,
    ):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None and 0 <= candidate < vocab_size:
            return int(candidate)
    return 0


def _token_stream(tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer(_PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    else:
        # Byte-level fallback for models saved without a tokenizer (the presets reserve ids 0-255 for it).
        ids = list(_PROMPT_TEXT.encode())
    return [i % vocab_size for i in ids]


def _left_padded(rows: list[list[int]], pad_id: int, device: torch.device | str) -> Prompts:
    """Rows of token ids left-padded with ``pad_id`` to the longest, as batched generation pads them."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return Prompts(ids.to(device), mask.to(device))


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
    rows = []
    for row in range(batch_size):
        length = max(1, prompt_len - (row * prompt_len) // (2 * batch_size)) if left_pad else prompt_len
        # Repeat the passage as often as needed; offset rows so they differ.
        start = 7 * row
        rows.append([stream[(start + k) % len(stream)] for k in range(length)])
    # Every row of an unpadded batch is prompt_len long, so padding to the longest pads nothing.
    return _left_padded(rows, pad_id, device)


def chat_prompts(
    tokenizer: PreTrainedTokenizerBase, batch_size: int, pad_id: int, device: torch.device | str = "cpu"
) -> tuple[Prompts, list[str]]:
    """``batch_size`` rows asking ``QUESTIONS`` in turn, left-padded, and the questions asked.

    Each question goes through the tokenizer's chat template (as a user turn, with the prompt for the
    assistant's answer) when it has one, else it is tokenized as plain text.
    """
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(batch_size)]
    if getattr(tokenizer, "chat_template", None):
        rows = [
            list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"])
            for q in questions
        ]
    else:
        rows = [tokenizer(q)["input_ids"] for q in questions]
    return _left_padded(rows, pad_id, device), questions


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


def generation_config(
    new_tokens: int, pad_id: int, eos_id: int | list[int] | None = None, *, compile_on: str | None = None
) -> GenerationConfig:
    """Greedy decoding, ignoring the checkpoint's sampling defaults: exactly ``new_tokens`` tokens per row, or,
    given ``eos_id``, at most that many (a row ends at its end-of-sequence token, as a chat answer does).

    ``compile_on`` (a device type) asks for transformers' compiled generation: a static cache, and each decoding
    step through ``torch.compile`` of the model's forward (the prompt's forward stays eager), in
    ``COMPILE_MODES[compile_on]``."""
    lengths = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens) if eos_id is None else dict(
        max_new_tokens=new_tokens, eos_token_id=eos_id)
    compiled = {} if compile_on is None else dict(cache_implementation="static",
                                                   compile_config=_compile_config(compile_on))
    return GenerationConfig(do_sample=False, pad_token_id=pad_id, **lengths, **compiled)


# torch.compile's mode for compiled generation per device type: CUDA graphs on a GPU, where a decoding step is
# bound by host time; on CPU inductor's default (the kernels run in Triton's interpreter there: a parity check).
COMPILE_MODES = {"cuda": "reduce-overhead", "cpu": "default"}


def _compile_config(device_type: str) -> CompileConfig:
    config = CompileConfig(fullgraph=True, dynamic=False, mode=COMPILE_MODES[device_type])
    # transformers compiles generation on GPUs (and a few accelerators) only, unless this flag says otherwise.
    config._compile_all_devices = device_type != "cuda"
    return config


@dataclass
class Generation:
    """What greedy ``generate()`` appended to each row: ``tokens`` ``[batch, steps]`` and the raw
    ``logits`` ``[steps, batch, vocab]`` each token was chosen from (on the CPU, in the model's dtype)."""

    tokens: Tensor
    logits: Tensor


@torch.no_grad()
def greedy_tokens(
    model: PreTrainedModel, prompts: Prompts, new_tokens: int, pad_id: int, *, compile_on: str | None = None
) -> Generation:
    """Greedy ``generate()`` of up to ``new_tokens`` tokens per row, ending rows at the model's end-of-sequence
    token, with the logits behind every choice (``output_logits``: before any logits processor); compiled
    generation with ``compile_on`` (see ``generation_config``)."""
    out = model.generate(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        generation_config=generation_config(new_tokens, pad_id, model.generation_config.eos_token_id,
                                            compile_on=compile_on),
        output_logits=True,
        return_dict_in_generate=True,
    )
    return Generation(
        tokens=out.sequences[:, prompts.input_ids.shape[1]:].cpu(),
        logits=torch.stack([step.cpu() for step in out.logits]),
    )
