"""Tiny causal LMs, a tokenizer, a prompt set and a reward for the TRL / verl
adapter tests (no downloads: everything is made in code; needs torch,
transformers and tokenizers, i.e. the TRL environment .venv-trl).

- ``tokenizer()``: a ``PreTrainedTokenizerFast`` over a WordLevel model of
  ``VOCAB`` words ("<pad>", "<eos>", "<unk>", "w0" ...), split on spaces.
- ``save_model(kind, path, seed)``: a random ``Qwen2ForCausalLM`` with an
  untied ``lm_head`` (``kind="qwen2"``), a ``LlamaForCausalLM`` with tied
  embeddings (``"llama_tied"``), a ``GraniteForCausalLM`` (``"granite"``:
  ``logits_scaling`` 8) or a ``Gemma2ForCausalLM`` (``"gemma2"``:
  ``final_logit_softcapping`` 30, tied), hidden size ``HIDDEN``, saved with
  the tokenizer by ``save_pretrained`` (float32).
- ``prompts()``, ``reward(completions)``: a deterministic prompt set and
  reward (how often "w5" occurs, minus a length penalty).
"""

import os

VOCAB = 64
HIDDEN = 32
WORDS = ["<pad>", "<eos>", "<unk>"] + ["w%d" % i for i in range(VOCAB - 3)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_model(kind, seed=0):
    """A random tiny model of ``kind`` ("qwen2": untied; "llama_tied")."""
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig,
                              LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
    elif kind == "llama_tied":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
        assert model.lm_head.weight is model.model.embed_tokens.weight
    elif kind == "granite":  # logits divided by logits_scaling (TRL: logit_scale = 1 / 8)
        model = GraniteForCausalLM(GraniteConfig(logits_scaling=8.0, tie_word_embeddings=False, **common))
    elif kind == "gemma2":  # final_logit_softcapping, tied embeddings
        model = Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=30.0, head_dim=16, **common))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # larger logits than the default init, so the heads' numerics matter
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def save_model(kind, path, seed=0):
    """Saves ``make_model(kind, seed)`` and ``tokenizer()`` into ``path``;
    returns the model."""
    model = make_model(kind, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return model


def prompts(n=8):
    return ["w%d w%d w%d" % (i, (i * 3 + 1) % 50, (i * 7) % 50) for i in range(n)]


def reward(completions, **kwargs):
    """Deterministic: occurrences of "w5" minus 0.1 per word."""
    return [float(sum(t == "w5" for t in c.split())) - 0.1 * len(c.split()) for c in completions]
