"""What the tests expect of each encoder and encoder-decoder type's tiny model, in one table: ``CASES``, keyed by
model type.

A row names the task-head class the tests build (the base model plus a head: any head holds the same norms), the
LayerNorms patch_model patches in it and the residual adds it fuses (derived forwards: the argument pattern of
post-LN sublayers, ``LayerNorm(dropout(dense(h)) + input)``, and the patterns of pre-LN layers). The tiny config is
harness.coverage's (``_tiny_config(model_type, ENCODER)``, 2 layers), its inputs harness.coverage's ``_inputs``, so
the page and the tests build the same models.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType


@dataclasses.dataclass(frozen=True)
class EncoderCase:
    """``head``: the transformers class built; ``norms`` patched and ``adds`` fused by a plain ``patch_model``."""

    model_type: str
    head: str
    norms: int
    adds: int


CASES = MappingProxyType({case.model_type: case for case in (
    # Post-LN encoders: the embeddings' LayerNorm, then two post-LN sublayers per layer. The adds counted are the
    # sites patched (the embeddings' included: it fuses where the position embeddings have the batch's shape).
    EncoderCase("bert", "BertForSequenceClassification", 5, 5),
    EncoderCase("roberta", "RobertaForTokenClassification", 5, 5),
    EncoderCase("xlm-roberta", "XLMRobertaForSequenceClassification", 5, 5),
    EncoderCase("camembert", "CamembertForSequenceClassification", 5, 5),
    EncoderCase("electra", "ElectraForTokenClassification", 5, 5),
    EncoderCase("mpnet", "MPNetForSequenceClassification", 5, 5),
    # DeBERTa: its own LayerNorm class, in the deberta mode; as in DeBERTa-v2, the embeddings' add is not fused.
    EncoderCase("deberta", "DebertaForSequenceClassification", 5, 4),
    EncoderCase("deberta-v2", "DebertaV2ForSequenceClassification", 5, 4),
    EncoderCase("distilbert", "DistilBertForSequenceClassification", 5, 5),
    EncoderCase("albert", "AlbertForSequenceClassification", 3, 3),  # one layer shared by every repeat
    EncoderCase("modernbert", "ModernBertForSequenceClassification", 6, 4),  # pre-LN, the head's own norm
    # Pre-LN vision and text towers: two adds inside each layer, the first layer's output into the next's norm.
    EncoderCase("vit", "ViTForImageClassification", 5, 4),
    EncoderCase("clip_vision_model", "CLIPVisionModel", 6, 3),
    EncoderCase("clip_text_model", "CLIPTextModel", 5, 3),
    EncoderCase("siglip_vision_model", "SiglipVisionModel", 6, 3),
    EncoderCase("siglip_text_model", "SiglipTextModel", 5, 3),
    # Encoder-decoders: post-LN layers (BART, Marian) fuse every add; pre-LN ones (mBART, Pegasus, Whisper) too,
    # through the ``if`` around the decoder's cross-attention block (its self-attention add planned once for each
    # branch: three sites per decoder layer) and the one after the encoder's output add (the fp16 clamp).
    EncoderCase("bart", "BartForConditionalGeneration", 12, 10),
    EncoderCase("mbart", "MBartForConditionalGeneration", 14, 12),
    EncoderCase("marian", "MarianMTModel", 10, 10),
    EncoderCase("pegasus", "PegasusForConditionalGeneration", 12, 12),
    EncoderCase("whisper", "WhisperForConditionalGeneration", 12, 12),
)})
