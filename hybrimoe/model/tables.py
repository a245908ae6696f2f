"""Upstream llama.cpp's per-architecture facts that hybrimoe needs, each stated once: the routed-expert tensor names,
the router's gating functions and the expert FFN variants of ``llm_graph_context::build_moe_ffn``.

Read by :mod:`hybrimoe.model.reader` (what a GGUF holds), :mod:`hybrimoe.model.facts` (the facts' ``gating``
field), the engine's set-up (the tensor override that keeps routed experts in host memory) and the traces' format.
"""
from __future__ import annotations

import re

#: upstream's LLM_FFN_EXPS_REGEX (common/common.h): every routed-expert weight tensor, as ``-ot`` rules match them
#: (``chexps``: the chunked expert tensors some converters write)
EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
#: the kinds of routed-expert matrices: gate, up, down, or gate and up fused in one tensor (gpt-oss, some deepseek2)
EXPERT_KINDS = ("gate", "up", "down", "gate_up")
#: a routed-expert tensor by full name: block, kind, and what it holds (weights, per-expert bias rows or scales)
EXPERT_TENSOR_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias|scale)$")
#: any tensor of a block (``blk.N.``)
BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
#: the parts of a block's other (non-routed-expert) tensors, as :func:`hybrimoe.model.reader.describe` sorts them
LAYER_PARTS = ("attention", "shared_experts", "router", "norms", "dense_ffn", "other")

#: upstream's llama_expert_gating_func_type (src/llama-hparams.h), by the value of ``<arch>.expert_gating_func``
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}
#: the gating names a model's facts and a trace may carry ("" = unknown)
GATINGS = tuple(GATING_FUNCS.values()) + ("",)
#: architectures whose graph gates with another function than softmax when the key is absent (upstream's
#: models/openai-moe.cpp and models/llama4.cpp pass it to build_moe_ffn)
ARCH_GATING = {"gpt-oss": "softmax_weight", "llama4": "sigmoid"}

#: the expert activation (build_moe_ffn's type_op) each architecture's graph passes, where it is not SiLU
#: (upstream's src/models/*.cpp)
ARCH_ACTIVATION = {"gpt-oss": "swiglu_oai", "minimax-m3": "swiglu_oai", "grok": "gelu", "gemma4": "gelu",
                   "nomic-bert-moe": "gelu", "nemotron_h": "relu_sqr", "nemotron_h_moe": "relu_sqr",
                   "smallthinker": "relu", "kimi-k3": "situ"}
#: the activations' names as ``hybrimoe info`` prints them
ACTIVATION_NAMES = {"silu": "SiLU", "swiglu_oai": "SwiGLU-OAI", "gelu": "GELU", "relu": "ReLU",
                    "relu_sqr": "squared ReLU", "situ": "SITU"}
#: architectures that read ``<arch>.swiglu_clamp_exp``, and of those the ones build_moe_ffn clamps with
#: ggml_swiglu_clamp (the others: clamp, silu, clamp, mul)
CLAMP_ARCHS = ("bailingmoe3", "deepseek4", "dflash", "glm5-next", "hy_v4", "maple", "step35")
CLAMP_FUSED = ("deepseek4", "glm5-next", "hy_v4", "maple", "dflash")
#: architectures whose graph weights the input by the router before the experts (llama4's build_moe_ffn call)
WEIGHT_BEFORE_FFN_ARCHS = ("llama4",)
