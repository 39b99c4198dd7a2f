"""``linearize.fold``: turn a linearized model into a smaller plain PyTorch model.

The returned model is a new module (the input is never changed), like PEFT's
``merge_and_unload``: use the return value. Folding rewrites modules in place of the copy
(no ``torch.fx`` GraphModule), so ``generate`` / ``save_pretrained`` of Hugging Face models
keep working. The copy is walked bottom-up and at every module an ordered list of fold rules
(:mod:`.rules`; users add their own with :func:`register_fold_rule`) decides what to do:

1. ``sequential`` (:mod:`.chains`): in every ``nn.Sequential`` that runs as a chain (nested ones
   flattened, names kept; one whose layers another forward calls by name is left as is) drops units whose
   channels are all linear (slope ``a >= 1 - tol``: the identity), folds BatchNorm (eval
   statistics) into the preceding conv / linear layer, and merges runs of adjacent linear maps
   (``Linear o Linear``, ``Conv o Conv``, grouped and depthwise convs, 1x1 convs into neighbours)
   where that is exact and better under the :class:`Objective` (a small dynamic program);
2. ``torchvision-*`` / ``timm-*`` (:mod:`.blocks`, :mod:`.inverted`): merges the convs of residual
   blocks between linear sites where cheaper (pieces in place, e.g. a Bottleneck's 1x1 -> 3x3), and
   folds a residual skip (identity, or a 1x1 downsample conv with the merged stride) into the centre
   tap of a merged conv (MobileNet-V2/V3 and timm inverted residuals, DepthShrinker-style;
   torchvision Bottleneck, and BasicBlock with ``objective="depth"``);
3. ``ffn-by-shape`` / ``ffn-by-path`` (:mod:`.ffn`): splits FFNs ``W2 act(W1 x + b1) + b2`` with
   ``k`` linear channels out of ``m`` into a narrower FFN plus one ``d x d`` linear path
   ``W2[:, L] W1[L, :]`` (a fully linear FFN becomes one layer), found by shape in any module
   (timm ``Mlp``, torchvision ``MLPBlock``, GPT-2, T5, Marian/BART, users' blocks) or by
   attribute paths (BERT);

then every remaining unit becomes a plain module (:mod:`.modules`): ``nn.ReLU``-style activation
(slopes all 0), :class:`ChannelPReLU` (mixed ReLU family) or :class:`ChannelBlend` (mixed smooth
units). Two zero-padded convs merge exactly only with a border fix (:mod:`.conv`).

Then it verifies (:mod:`.verify`): ``example_inputs`` run through both models and the max abs
difference must stay below ``rtol * max|output|`` (or ``atol``); the summary holds the error,
params, FLOPs (:func:`count_flops`) and measured latency before and after, and one
:class:`MergeRecord` per merge (rule, FLOPs, and with ``merge_latency=True`` the batch-1 latency
that decided it).
"""

from __future__ import annotations

from ..checks import FoldVerificationError
from .blocks import RESNET_BLOCK, RESNET_STEM
from .chains import fold_chain, is_plain_sequential
from .conv import BorderBiasConv, BorderExactConv
from .core import fold
from .ffn import FFN_BY_PATH, FFN_BY_SHAPE, GATED_FFN
from .inverted import TIMM_INVERTED_RESIDUAL, TORCHVISION_INVERTED_RESIDUAL
from .flops import count_flops
from .modules import ChannelBlend, ChannelPReLU, ConvWithPassthrough, LinearWithPassthrough
from .rules import Cost, FoldContext, FoldRule, Objective, fold_rules, register_builtin, register_fold_rule, unregister_fold_rule
from .summary import FoldSummary, MergeRecord

__all__ = [
    "fold",
    "FoldSummary",
    "MergeRecord",
    "FoldVerificationError",
    "FoldRule",
    "FoldContext",
    "Objective",
    "Cost",
    "register_fold_rule",
    "unregister_fold_rule",
    "fold_rules",
    "ChannelPReLU",
    "ChannelBlend",
    "LinearWithPassthrough",
    "ConvWithPassthrough",
    "BorderBiasConv",
    "BorderExactConv",
    "count_flops",
]

SEQUENTIAL = FoldRule("sequential", lambda m, ctx: is_plain_sequential(m), fold_chain)

register_builtin([SEQUENTIAL, TORCHVISION_INVERTED_RESIDUAL, TIMM_INVERTED_RESIDUAL, RESNET_BLOCK, RESNET_STEM, FFN_BY_SHAPE, FFN_BY_PATH, GATED_FFN])
