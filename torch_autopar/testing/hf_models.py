"""Popular ``transformers`` models built from small configs (no download), with their inputs, for tests and
benchmarks: each is called the way its documentation shows (``model(**batch).loss``).

Dropout is off so that runs are deterministic; attention implementation and masks are each model's defaults.
Needs the optional ``transformers`` package (the ``dev`` extra). Must never download anything.
"""

from __future__ import annotations

import torch

HF_MODELS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "mixtral", "deepseek_v3", "bert", "t5",
             "vit")
DECODERS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
"""The causal language models built from ``_decoder_config``: the class name in ``transformers`` (its config class
is named alike, ending in ``Config``)."""
VOCAB = 128
SEQ = 16
IMAGE = 16


def _decoder_config(kind: str, layers: int, width: int):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attention_dropout=0.0, tie_word_embeddings=False)
    if kind in ("qwen3", "gemma2"):
        common["head_dim"] = width // 4
    if kind == "gemma2":  # its attention scale from the head dim; every other layer's window shorter than SEQ
        common.update(query_pre_attn_scalar=width // 4, sliding_window=SEQ // 2)
    if kind == "phi3":  # its default padding token (32000) lies outside the small vocabulary
        common.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "mixtral":  # a mixture of experts: 4 experts, each token routed to 2
        common.update(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    if kind == "deepseek_v3":  # multi-head latent attention (as many key/value heads as query heads), a dense
        # first layer, then 4 routed experts (top-2) and a shared one
        common.update(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                      v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=width,
                      n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    return getattr(transformers, DECODERS[kind].replace("ForCausalLM", "Config"))(**common)


def build_hf_model(name: str, seed: int = 0, *, layers: int = 2, width: int = 64) -> torch.nn.Module:
    """A freshly initialised ``transformers`` model (deterministic given ``seed``), in training mode: ``layers``
    blocks (each of T5's stacks) of hidden size ``width`` (4 heads; feed-forward 2 x width, GPT-2's 4 x)."""
    import transformers

    torch.manual_seed(seed)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=width, n_layer=layers, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    elif name in DECODERS:
        model = getattr(transformers, DECODERS[name])(_decoder_config(name, layers, width))
    elif name == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=layers,
                                         num_attention_heads=4, intermediate_size=2 * width, max_position_embeddings=64,
                                         num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForSequenceClassification(config)
    elif name == "t5":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=width, d_kv=width // 4, d_ff=2 * width,
                                       num_layers=layers, num_decoder_layers=layers, num_heads=4, dropout_rate=0.0,
                                       decoder_start_token_id=0, pad_token_id=0)
        model = transformers.T5ForConditionalGeneration(config)
    elif name == "vit":
        config = transformers.ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=width,
                                        num_hidden_layers=layers, num_attention_heads=4, intermediate_size=2 * width,
                                        num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.ViTForImageClassification(config)
    else:
        raise ValueError(f"unknown transformers model {name!r}; expected one of {HF_MODELS}")
    return model.train()


def hf_batch(name: str, batch: int, step: int = 0) -> dict[str, torch.Tensor]:
    """The keyword inputs of one global batch (with labels, so the model returns its loss)."""
    generator = torch.Generator().manual_seed(1000 + step)
    if name == "vit":
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=generator),
                "labels": torch.randint(0, 5, (batch,), generator=generator)}
    tokens = torch.randint(1, VOCAB, (batch, SEQ), generator=generator)
    if name == "bert":
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens),
                "labels": torch.randint(0, 3, (batch,), generator=generator)}
    if name == "t5":
        return {"input_ids": tokens, "labels": torch.randint(1, VOCAB, (batch, SEQ // 2), generator=generator)}
    return {"input_ids": tokens, "labels": tokens}


def local_batch(inputs: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's slice of a global batch (dim 0 chunked, the DDP convention)."""
    return {key: value.chunk(world)[rank] for key, value in inputs.items()}


def next_token_loss(output, target: torch.Tensor) -> torch.Tensor:
    """A causal language model's loss from its own output object (``output.logits``, batch x sequence x vocab)
    against next-token targets (batch x sequence): what a pipelined model's ``loss_fn`` gets."""
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())
