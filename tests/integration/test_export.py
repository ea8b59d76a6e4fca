"""``rlboost export`` of a text model: its tokenizer and chat template come along.

A tiny-chat-shaped model (Qwen2, the byte-level BPE tokenizer with its chat template, a
generation config listing two EOS ids) is checkpointed the way the trainer does
(:class:`trainer_svc.learn.checkpoint.RunCheckpoints`), published to a real weight service behind a
write and a read token, and exported with the read token. ``AutoTokenizer`` then renders a chat
prompt exactly as the trainer's :class:`trainer_svc.inputs.chat.ChatFormat` did, and
``AutoModelForCausalLM`` generates from it, stopping on the generation config's EOS ids. A LoRA
version exports as its PEFT adapter, or with ``merged`` as the merged model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2ForCausalLM

from rlboost.export import ExportError, export
from shared.spec import LoraSpec
from shared.weights import upload_version
from shared.weights.manifest import ADAPTER_SUFFIX
from tests.integration.test_weight_svc import ServiceProcess
from trainer_svc.embedded.tiny_chat import (
    ENDOFTEXT,
    IM_END,
    tiny_chat_config,
    token_id,
    train_tokenizer,
)
from trainer_svc.inputs.chat import ChatFormat, eos_token_ids
from trainer_svc.learn import lora
from trainer_svc.learn.checkpoint import RunCheckpoints

WRITE, READ = "export-write", "export-read"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(tmp_path_factory.mktemp("svc"), token=WRITE,
                         RLBOOST_WEIGHTS_READ_TOKEN=READ)
    svc.start()
    yield svc
    svc.stop()


def chat_base(root: Path) -> Path:
    tokenizer = train_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_chat_config(tokenizer))
    ends = [token_id(tokenizer, t) for t in (IM_END, ENDOFTEXT)]
    model.generation_config = GenerationConfig(eos_token_id=ends, pad_token_id=ends[1])
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


async def test_exported_chat_model_loads_with_its_tokenizer_and_generates(
        service: ServiceProcess, tmp_path: Path) -> None:
    base = chat_base(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base)
    checkpoints = RunCheckpoints(tmp_path / "run", base)
    checkpoints.save(model, torch.optim.AdamW(model.parameters()), 1)
    await upload_version(service.url, WRITE, "run-chat", 1, checkpoints.hf_dir(1))

    done = await export(service.url, READ, "run-chat", tmp_path / "out")
    assert done.version == 1 and (tmp_path / "out" / "model.safetensors").is_file()
    want = ChatFormat(AutoTokenizer.from_pretrained(base), system_prompt="Be brief.").render(
        "Tom has 3 apples and buys 4 more. How many?")
    tokenizer = AutoTokenizer.from_pretrained(done.path)
    got = ChatFormat(tokenizer, system_prompt="Be brief.").render(want.prompt)
    assert got == want and got.prompt_text != got.prompt  # the chat template came along
    ends = eos_token_ids(done.path, tokenizer)
    assert ends == [token_id(tokenizer, IM_END), token_id(tokenizer, ENDOFTEXT)]
    exported = AutoModelForCausalLM.from_pretrained(done.path)
    out = exported.generate(torch.tensor([got.prompt_token_ids]), max_new_tokens=12,
                            do_sample=False)[0, len(got.prompt_token_ids):].tolist()
    assert 1 <= len(out) <= 12 and (len(out) == 12 or out[-1] in ends)
    assert isinstance(tokenizer.decode(out, skip_special_tokens=True), str)


async def test_a_version_without_an_hf_model_is_refused(service: ServiceProcess,
                                                        tmp_path: Path) -> None:
    emu = tmp_path / "emu"
    emu.mkdir()
    (emu / "weights.bin").write_bytes(b"\0" * 64)
    await upload_version(service.url, WRITE, "run-emu", 2, emu)
    with pytest.raises(ExportError, match="not an HF model directory"):
        await export(service.url, READ, "run-emu", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["emu"]  # no scratch left behind
    with pytest.raises(ExportError, match="no version of run run-none"):
        await export(service.url, READ, "run-none", tmp_path / "out")


async def test_lora_version_exports_its_adapter_or_merged_model(service: ServiceProcess,
                                                                tmp_path: Path) -> None:
    base = chat_base(tmp_path / "base")
    policy = lora.wrap(AutoModelForCausalLM.from_pretrained(base), LoraSpec(rank=4, alpha=8.0))
    with torch.no_grad():  # a trained adapter: B is zero until the first step
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    checkpoints = RunCheckpoints(tmp_path / "run", base)
    checkpoints.save(policy, torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad]), 3)
    await upload_version(service.url, WRITE, "run-lora", 3, checkpoints.hf_dir(3))
    ids = torch.tensor([[5, 40, 41, 7, 99, 12]])
    with torch.no_grad():
        want = policy(input_ids=ids).logits

    done = await export(service.url, READ, "run-lora", tmp_path / "adapter")
    assert done.adapter and not (tmp_path / "adapter" / "model.safetensors").exists()
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(
        done.files)
    assert not [n for n in done.files if n.endswith(ADAPTER_SUFFIX) or n == "config.json"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), done.path)
    with torch.no_grad():
        assert torch.equal(adapted(input_ids=ids).logits, want)

    merged = await export(service.url, READ, "run-lora", tmp_path / "merged", merged=True)
    assert not merged.adapter and "model.safetensors" in merged.files
    assert not [n for n in merged.files if "adapter" in n]
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged.path)(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # What a LoRA version costs on top of its merged model, at tiny-chat's shape and rank 4.
    sizes = {p.name: p.stat().st_size for p in checkpoints.hf_dir(3).iterdir()}
    extra = sum(v for k, v in sizes.items() if k.endswith(ADAPTER_SUFFIX))
    print(f"tiny-chat, rank 4: adapter {extra} B vs model {sizes['model.safetensors']} B "
          f"({100 * extra / sizes['model.safetensors']:.1f} %)")
    assert extra < 0.05 * sizes["model.safetensors"]
