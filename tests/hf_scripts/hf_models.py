"""The tiny models and data of the Hugging Face runs, and a hand-written GPT-2 training step.

Apart from ``hf_train.py`` so that the processes of ``check_exact_resume`` (which import the
module of ``build_gpt2``) import transformers' model classes alone, not the Trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

SAMPLES = 40  # 10 steps an epoch on one rank (5 on two): a resume lands mid-epoch, the run crosses epochs
VOCAB = 64


def build_model(name: str) -> torch.nn.Module:
    """A tiny model of ``name``, its initial weights fixed by the seed."""
    torch.manual_seed(0)
    if name == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            attention_dropout=0.1,
            bos_token_id=0,
            eos_token_id=1,
        )
        return LlamaForCausalLM(cfg)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=1)
    )
    if name == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1))
    return model


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences, each its own label (causal LM)."""

    def __init__(self, n: int = SAMPLES, length: int = 16) -> None:
        self.ids = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Position:
    """Which sample comes next (an extra state)."""

    def __init__(self) -> None:
        self.sample = 0

    def state_dict(self) -> dict[str, int]:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sample = state["sample"]


def build_gpt2() -> dict[str, Any]:
    """The tiny GPT-2 of the Trainer runs (dropout on), AdamW and a linear warmup schedule."""
    from transformers import get_linear_schedule_with_warmup

    model = build_model("gpt2")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": {"data": Position()}}


def step_gpt2(objs: dict[str, Any], i: int) -> None:
    data = objs["extra"]["data"]
    ids = Tokens().ids[data.sample : data.sample + 4]
    data.sample += 4
    loss = objs["model"](input_ids=ids, labels=ids).loss  # dropout: the torch generator's draws
    objs["optimizer"].zero_grad()
    loss.backward()
    objs["optimizer"].step()
    objs["scheduler"].step()
