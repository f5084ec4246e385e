"""What ``patch_model`` returns (``PatchReport``) and raises when it changes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

# What ``report.skipped`` says first of an attention module whose q/k norms and RoPE stay apart (``qk_attention``).
QK_APART = "q/k norms and RoPE not fused: "


def qk_summary(fused: int, apart: int) -> str:
    """The summary's clause on the q/k norms + RoPE fusion: how many attention modules run their q/k norms and RoPE
    as one launch, and how many were left apart (each listed, with its reason, among the skipped); empty for a
    model with neither."""
    if not fused and not apart:
        return ""
    modules = "attention module" if fused == 1 else "attention modules"
    return f"; q/k norms fused with the RoPE in {fused} {modules} ({apart} left apart)"


class UnsupportedModelError(ValueError):
    """``patch_model`` found nothing it can patch exactly; the model was left untouched."""


class UnconvertibleModelError(UnsupportedModelError):
    """``patch_model(model, layernorm="rmsnorm")`` cannot convert the model's LayerNorms to RMSNorm exactly (a
    post-LN model such as BERT or OPT-350m, fp16/bf16 writers, an unknown stack); the model was left untouched."""


@dataclass
class PatchReport:
    """What ``patch_model`` changed.

    Attributes:
        norms: qualified names of the norm modules now running the kernels.
        fused_adds: the residual adds now computed inside a norm kernel, one line per add.
        fused_qk: the attention modules whose query and key norms and rotary embedding now run as one
            ``qk_norm_rope`` launch (``qk_rope_norm``: the RoPE first), one line each naming the norms and the RoPE
            function.
        skipped: ``(qualified name, reason)`` for every norm-like module left alone, every decoder layer
            whose residual adds stay unfused, and every attention module with two patched norms whose q/k norms
            and RoPE stay apart (its reason starts with ``QK_APART``; ``qk_apart`` lists those).
        families: the model families whose norms were patched.
        converted: the ``nn.LayerNorm`` modules converted to RMSNorm (``layernorm="rmsnorm"`` only; also listed
            in ``norms``). By default LayerNorms stay LayerNorms, computed by the fused kernels.
        centred: the parameters the conversion to RMSNorm changed (centred once, when patching).
        centred_inputs: the layers whose input the conversion centres on every forward (the stream's entrance).
        backend: what runs the norms where the model's weights are now (``hf_rmsnorm.ops.backend.describe``):
            the compiled Triton kernels, the same kernels in Triton's CPU interpreter, or the PyTorch path.
        hub_forwards: the patched modules whose hub-kernel forward (installed on the instance by
            ``kernels.kernelize``) is set aside while patched, one line each naming the hub layer: the fused
            forward runs instead, and ``unpatch_model`` puts the hub one back.
    """

    norms: list[str] = field(default_factory=list)
    fused_adds: list[str] = field(default_factory=list)
    fused_qk: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)
    centred: list[str] = field(default_factory=list)
    centred_inputs: list[str] = field(default_factory=list)
    backend: str = ""
    hub_forwards: list[str] = field(default_factory=list)

    @property
    def qk_apart(self) -> list[tuple[str, str]]:
        """The attention modules whose q/k norms and RoPE stay apart: ``(qualified name, reason)``, from
        ``skipped``."""
        return [(name, reason) for name, reason in self.skipped if reason.startswith(QK_APART)]

    def __str__(self) -> str:
        families = f" ({', '.join(self.families)})" if self.families else ""
        lines = [
            f"hf_rmsnorm: {len(self.norms)} norms patched{families}, {len(self.fused_adds)} residual adds fused, "
            f"{len(self.skipped)} skipped"
        ]
        if self.converted:
            lines[0] += f"; {len(self.converted)} LayerNorms converted to RMSNorm"
        lines[0] += qk_summary(len(self.fused_qk), len(self.qk_apart))
        if self.backend:
            lines.append(f"  runs on: {self.backend}")
        for title, items in (
            ("norms", self.norms),
            ("LayerNorms converted to RMSNorm", self.converted),
            ("parameters centred (once, by the conversion)", self.centred),
            ("inputs centred on every forward (by the conversion)", self.centred_inputs),
            ("fused residual adds", self.fused_adds),
            ("q/k norms fused with the RoPE", self.fused_qk),
            ("hub-kernel forwards set aside while patched", self.hub_forwards),
            ("skipped", [f"{name or '<root>'}: {reason}" for name, reason in self.skipped]),
        ):
            if items:
                lines.append(f"  {title}:")
                lines.extend(f"    {item}" for item in items)
        return "\n".join(lines)
