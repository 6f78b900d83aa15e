"""The tiny vision-language model (``connectors.tiny_vl``) on both sides: in the real engine, vLLM generates from an
image with the logprobs of a transformers forward, and weights moved through a store load into it, tower and
connector included; in the trainer, Megatron-core's ``LLaVAModel`` built from the folder (``train.vl_model``) has
the same logits and tower gradients, gives its weights back under the folder's names bit for bit, and with the
tower run once per distinct image of a mini-batch has the gradients of the plain model.

Both run in subprocesses: the engine as this file run as a script (``__main__``), as the text model's weight test
does; the trainer as ``python -m train.vl_model FOLDER``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher.children import child_env

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "<image>how many squares?"


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "vl"
    code = f"from connectors.tiny_vl import build_tiny_vl; build_tiny_vl({str(out)!r}, seed=0)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), check=True, timeout=180,
                   capture_output=True)
    return out


def test_the_builder_refuses_a_grid_the_connector_cannot_merge(tmp_path: Path) -> None:
    from connectors.tiny_vl import build_tiny_vl

    with pytest.raises(ValueError, match="even grid"):
        build_tiny_vl(tmp_path, image_size=42, patch=14)  # 3x3 patches: no 2x2 blocks


@pytest.mark.slow
def test_megatron_llava_from_the_folder_scores_as_transformers_maps_its_weights_and_encodes_each_image_once(
        tiny_vl: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "train.vl_model", str(tiny_vl)], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["images"] == 1 and doc["tokens"] == 20
    assert doc["logprob_max_abs_diff"] < 1e-4  # every position, image tokens included
    assert doc["tower_grad_max_rel_diff"] < 1e-4  # the loss reaches the patch convolution as in transformers
    assert doc["round_trip_names_equal"] and doc["round_trip_mismatched"] == [] and doc["tensors"] == 59
    # the tower once per distinct image of the mini-batch, its tokens feeding every micro-batch: the gradients of
    # every parameter (tower, projector, backbone) are those of the plain model, which encodes every reference
    dedup = doc["dedup"]
    assert (dedup["distinct_images"], dedup["references"]) == (3, 6)
    assert (dedup["encoder_images_dedup"], dedup["encoder_images_plain"]) == (3, 6)
    assert dedup["tower_params_with_grad"] > 0 and dedup["projector_params_with_grad"] == 1
    assert dedup["same_param_names"] and dedup["mismatched"] == []
    # the check can fail: with the upstream (causal) tower mask the logits are not transformers'
    assert doc["causal_tower"]["logprob_max_abs_diff"] > 0.1


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_generates_from_an_image_as_transformers_scores_it_and_takes_weights_from_the_store(
        store_nodes, tiny_vl: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    meta = json.loads((tiny_vl / "knittrans_tiny.json").read_text())
    assert meta["architecture"] == "idefics3" and meta["image_seq_len"] == 4
    (server,) = store_nodes(1)
    out = tmp_path / "vl.json"
    res = subprocess.run([sys.executable, __file__, str(tiny_vl), server.location, str(out)], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    # the image became the processor's four image tokens between its markers, in vLLM as in transformers
    assert doc["prompt_ids"] == doc["hf_prompt_ids"]
    assert doc["prompt_ids"].count(doc["image_token_id"]) == 4
    assert doc["before_vs_hf"] < 1e-4
    # every tensor loaded (tower, connector, backbone), and the engine scores with the new ones only
    assert doc["tensors_loaded"] == doc["tensors_in_model"]
    assert {"vision", "connector", "text"} <= set(doc["parts"])
    assert doc["after_vs_hf_new"] < 1e-4
    assert doc["after_vs_hf_old"] > 1e-2
    # a second image after the reload is encoded with the new tower, not served from a stale encoding
    assert doc["other_image_vs_hf_new"] < 1e-4


def _driver(model: str, location: str, out: str) -> None:
    """vLLM on ``model``: generate from an image, score it in transformers; publish perturbed weights to the store
    at ``location``, fetch and load them into the engine; generate again from the same and from another image."""
    from connectors.engine import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration
    from vllm import LLM, SamplingParams

    from connectors.engine_weights import WORKER_EXTENSION, load_weights_into_llm
    from flight_store.publishing import StorePublisher
    from flight_store.reading import StoreReader
    from flight_store.writing import StoreWriter
    from schemas.weights import from_tensors

    llm: Any = LLM(model=model, dtype="float32", max_model_len=256, seed=0, enforce_eager=True, max_num_seqs=4,
              distributed_executor_backend="uni", worker_extension_cls=WORKER_EXTENSION)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(2)]
    sp = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, flat_logprobs=True, seed=0)
    proc = AutoProcessor.from_pretrained(model)
    hf = Idefics3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32)

    def generate(image: Any) -> tuple[list[int], list[int], list[float]]:
        o = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], sp, use_tqdm=False)[0]
        return list(o.prompt_token_ids), list(o.outputs[0].token_ids), list(o.outputs[0].logprobs.logprobs)

    def diff(state: dict[str, Any], image: Any, run: tuple[list[int], list[int], list[float]]) -> float:
        p, r, lp = run
        hf.load_state_dict(state)
        pix = proc(text=[PROMPT], images=[[image]], return_tensors="pt")
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p + r]), pixel_values=pix["pixel_values"],
                        pixel_attention_mask=pix["pixel_attention_mask"]).logits[0]
        want = torch.log_softmax(logits.double(), -1)
        return float(np.abs(np.array([want[len(p) - 1 + i, t].item() for i, t in enumerate(r)]) - lp).max())

    old = {k: v.clone() for k, v in hf.state_dict().items()}
    first = generate(images[0])
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    with StoreReader(location) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        publisher.put_weights(from_tensors(new.items(), torch), 1)
        publisher.publish_version(1)
        table = writer.get_weights(client.get_version())
    loaded = load_weights_into_llm(llm, table)
    again, other = generate(images[0]), generate(images[1])
    doc = {
        "prompt_ids": first[0], "hf_prompt_ids": proc(text=[PROMPT], images=[[images[0]]])["input_ids"][0],
        "image_token_id": hf.config.image_token_id, "before_vs_hf": diff(old, images[0], first),
        "tensors_loaded": loaded, "tensors_in_model": len(old),
        "parts": sorted({n.split(".")[1].split("_")[0] for n in table.column("name").to_pylist()}),
        "after_vs_hf_new": diff(new, images[0], again), "after_vs_hf_old": diff(old, images[0], again),
        "other_image_vs_hf_new": diff(new, images[1], other),
    }
    Path(out).write_text(json.dumps(doc))


if __name__ == "__main__":
    _driver(*sys.argv[1:])
