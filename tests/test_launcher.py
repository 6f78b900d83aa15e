"""The launcher without an engine: ``knit`` and its flags (derived from the config classes), ``knit run``'s
configs and the documents its children get, the shape check, process groups, the report and plots from a
synthetic run folder, and the demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from admission.config import AdmissionConfig
from connectors.config import RolloutConfig
from launcher import cli
from launcher.children import Children
from launcher.flags import add_flags, build, field_docs, show_default
from launcher.main_job import parse
from launcher.model import check_shapes, trainer_model
from launcher.report import policy_summary, table_rows, write_summary
from launcher.run_config import RunConfig, rollout_config, train_config
from schemas import documents
from schemas.run_summary import PolicySummary, Throughput
from train.config import ModelConfig, TrainConfig
from train.hf_llama import hf_llama_config

ROOT = Path(__file__).resolve().parents[1]


# ---- knit run's configs -------------------------------------------------------------------------


def test_lookahead_defaults_per_policy() -> None:
    assert RunConfig().lookahead_groups == 10  # mini_batch: B + B/K (B=8, K=4)
    tb = RunConfig().for_policy("train_batch", Path("x"))
    assert tb.lookahead_groups == 16 and tb.out == Path("x")  # one whole train batch ahead
    two = RunConfig(admission=AdmissionConfig(train_batch_groups=8, group_size=4, mini_batches=2, dp_ranks=2))
    assert two.lookahead_groups == 12
    assert RunConfig(lookahead=9).lookahead_groups == 9
    colocated = RunConfig().for_policy("colocated", Path("c"))
    assert colocated.lookahead_groups == 8  # one train batch, generated with the weights it starts from
    assert rollout_config(colocated, ["grpc://127.0.0.1:1"]).synchronous == (8, 4)
    assert rollout_config(RunConfig(), ["grpc://127.0.0.1:1"]).synchronous is None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"train_batches": 0}, "train_batches=0"),
    ({"lookahead": 1}, "lookahead=1"),
    ({"num_stores": 0}, "num_stores=0"),
])
def test_run_config_refuses_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig(**kwargs)  # type: ignore[arg-type]


def test_children_get_validated_documents_with_the_run_geometry(tmp_path: Path) -> None:
    cfg = RunConfig(train_batches=3, out=tmp_path, seed=7).for_policy("train_batch", tmp_path)
    stores = ["grpc://127.0.0.1:1", "grpc://127.0.0.1:2"]
    trainer = documents.load(TrainConfig, documents.dump(train_config(cfg, trainer_model(300), stores)))
    assert trainer.max_steps == 12 and trainer.publish_weights and trainer.stores == stores  # 3 x K=4
    assert trainer.admission == cfg.admission and trainer.admission.policy == "train_batch"
    assert trainer.model.vocab_size == 300 and trainer.seed == 7 and trainer.optim.lr == cfg.optim.lr
    rollout = documents.load(RolloutConfig, documents.dump(rollout_config(cfg, stores)))
    assert rollout.group_size == cfg.admission.group_size and rollout.max_groups == 24
    assert rollout.max_unreleased_groups == 16 and rollout.lookahead_counts_running and rollout.weight_sync
    assert rollout.reward == "digits" and rollout.seed == 7 and rollout.stores == stores


def test_shape_check_names_every_mismatch() -> None:
    model = trainer_model(400)
    hf = hf_llama_config(model)
    check_shapes(hf, model)  # equal: no error
    bad = dict(hf, hidden_size=64, num_key_value_heads=4)
    with pytest.raises(ValueError, match="hidden_size") as exc:
        check_shapes(bad, model)
    assert "num_key_value_heads" in str(exc.value)
    with pytest.raises(ValueError, match="vocab_size"):
        check_shapes(hf, trainer_model(401))
    assert model.head_dim >= 32  # vLLM's CPU attention refuses head_dim 16
    assert ModelConfig.preset("tiny").hidden_size == 64  # the unit-test preset is unchanged


# ---- the knit command ---------------------------------------------------------------------------


def test_knit_lists_its_commands_and_refuses_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("serve", "run", "train", "rollout", "meta", "demo"):
        assert f"  {name} " in out
    assert cli.main(["explode"]) == 2
    assert "unknown command 'explode'" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_s_help_is_plain_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Flag help comes from the config fields' docstrings; the user reads it without their Sphinx markup."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--" in out  # the flags are listed
    for markup in (":attr:", ":class:", ":func:", ":meth:", ":mod:", "``"):
        assert markup not in out, (command, markup)


def _built(cls: type) -> tuple[object, frozenset[str]]:
    """A config of ``cls`` with nothing but its required fields given; and the names of those fields."""
    required = {f.name: f for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    given = {"stores": ["grpc://127.0.0.1:1"], "model": "m",
             "admission": AdmissionConfig(train_batch_groups=8, group_size=4)}
    return cls(**{name: given[name] for name in required}), frozenset(required)


@pytest.mark.parametrize("cls", [RunConfig, TrainConfig, RolloutConfig])
def test_every_field_has_one_flag_whose_default_is_what_the_config_holds(cls: type) -> None:
    """A flag's help shows the value the config gets without it: a section's own factory (``RunConfig``'s
    admission has B=8, K=2) wins over the section class's defaults (B required, K=1)."""
    parser = argparse.ArgumentParser()
    flags = add_flags(parser, cls)
    helps = {a.option_strings[0]: a.help or "" for a in parser._actions if a.option_strings}
    assert len({f.flag for f in flags}) == len(flags)
    config, required = _built(cls)
    for f in flags:
        assert field_docs(f.owner).get(f.path[-1]), f"{f.owner.__name__}.{f.path[-1]} has no docstring"
        field = next(x for x in dataclasses.fields(f.owner) if x.name == f.path[-1])
        value = config
        for name in f.path[:-1]:
            value = getattr(value, name) if value is not None else None
        if f.path[0] in required or value is None:  # a section given by the caller, or None: its class's defaults
            if field.default is not dataclasses.MISSING:
                assert f"default: {show_default(field.default)}" in helps[f.flag], f.flag
            elif field.default_factory is dataclasses.MISSING:
                assert "required" in helps[f.flag], f.flag
            continue
        value = getattr(value, f.path[-1])
        assert f"default: {show_default(value)}" in helps[f.flag], (f.flag, value, helps[f.flag])


def test_knit_run_help_shows_the_run_s_own_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, shown in (("--train-batch-groups", "8"), ("--mini-batches", "4"), ("--lr", "0.003")):
        assert f"{flag} " in out and f"(default: {shown})" in out.rsplit(f"{flag} ", 1)[1].split(" --", 1)[0], flag


def test_knit_run_flags_build_the_configs() -> None:
    configs, args = parse(["--quick", "--compare", "--group-size", "8", "--lr", "0.01", "--out", "/tmp/x"])
    assert [c.policy for c in configs] == ["train_batch", "mini_batch", "streaming"] and args.compare
    assert all(c.train_batches == 3 and c.admission.group_size == 8 and c.optim.lr == 0.01 for c in configs)
    assert [c.out for c in configs] == [Path("/tmp/x") / p for p in ("train_batch", "mini_batch", "streaming")]
    (one,), _ = parse(["--train-batches", "5", "--policy", "train_batch"])
    assert one.train_batches == 5 and one.policy == "train_batch" and one.admission.group_size == 4
    with pytest.raises(SystemExit):
        parse(["--mini-batches", "3"])  # 3 does not divide B = 8: refused by AdmissionConfig, named


def test_knit_run_policies_and_match_throughput_flags() -> None:
    configs, args = parse(["--policies", "train_batch,mini_batch,colocated", "--out", "/tmp/y"])
    assert [c.policy for c in configs] == ["train_batch", "mini_batch", "colocated"]
    assert [c.out for c in configs] == [Path("/tmp/y") / p for p in ("train_batch", "mini_batch", "colocated")]
    configs, args = parse(["--compare"])  # --compare matches throughput unless told not to
    assert args.match_throughput and configs[0].policy == "train_batch"
    assert not parse(["--compare", "--no-match-throughput"])[1].match_throughput
    assert not parse(["--policies", "train_batch,mini_batch"])[1].match_throughput
    assert parse(["--policies", "train_batch,mini_batch", "--match-throughput"])[1].match_throughput
    for bad in (["--policies", "mini_batch,fast"], ["--policies", "mini_batch,mini_batch"],
                ["--compare", "--policies", "train_batch"], ["--match-throughput"],
                ["--policies", "mini_batch,train_batch", "--match-throughput"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_match_throughput_takes_the_smallest_lookahead_whose_trajectories_per_s_keep_up() -> None:
    from launcher.main_job import _matched, lookaheads

    two = dataclasses.replace(RunConfig().admission, mini_batches=2)
    cfg = RunConfig(out=Path("/tmp/m"), admission=two).for_policy("mini_batch", Path("/tmp/m/mini_batch"))
    assert lookaheads(cfg) == [4, 8, 12, 16]  # one mini-batch of groups (B/K = 4) up to 2B
    assert lookaheads(RunConfig()) == [2, 4, 6, 8, 10, 12, 14, 16]  # the default K=4

    class Notes:
        def note(self, text: str) -> None:
            pass

    def runner(rates: dict[int, float]):  # type: ignore[no-untyped-def]
        ran: list[RunConfig] = []

        def run_one(c: RunConfig) -> PolicySummary:  # rates[L] trajectories/s, a 100 s window, 10 s of it idle
            ran.append(c)
            return PolicySummary(throughput=Throughput(trajectories_per_s=rates[c.lookahead_groups], tokens_per_s=0.0),
                                 trainer_idle_s=10.0, training_window_s=100.0,
                                 arch_staleness_mean=c.lookahead_groups / 10, quota_violations=0,
                                 config={"lookahead_groups": c.lookahead_groups})
        return run_one, ran

    baseline = PolicySummary(throughput=Throughput(trajectories_per_s=2.0, tokens_per_s=0.0))  # 1.9 needed
    run_one, ran = runner({4: 1.5, 8: 1.95, 12: 2.0, 16: 2.0})
    got = _matched(cfg, baseline, run_one, Notes())  # type: ignore[arg-type]
    assert [c.lookahead_groups for c in ran] == [4, 8] and ran[1].out == Path("/tmp/m/mini_batch/lookahead8")
    assert got.config["lookahead_groups"] == 8 and got.matched_throughput
    assert [(t.lookahead, t.trajectories_per_s, t.trainer_busy) for t in got.lookahead_search or []] == [
        (4, 1.5, 0.9), (8, 1.95, 0.9)]
    run_one, ran = runner({4: 1.0, 8: 1.8, 12: 1.7, 16: 1.75})
    got = _matched(cfg, baseline, run_one, Notes())  # type: ignore[arg-type]
    assert len(ran) == 4 and got.config["lookahead_groups"] == 8 and not got.matched_throughput
    # a trainer busy 90% of the window is not enough: 0.87 of train_batch's trajectories/s does not match
    run_one, ran = runner({4: 1.74, 8: 2.0, 12: 2.0, 16: 2.0})
    got = _matched(cfg, baseline, run_one, Notes())  # type: ignore[arg-type]
    assert len(ran) == 2 and got.config["lookahead_groups"] == 8 and got.matched_throughput


def test_knit_run_model_smollm2_maps_to_the_checkpoint_bf16_sync_and_exact_reward(tmp_path: Path) -> None:
    """``--model smollm2-135m``: the rollout serves the converted folder with its chat template, the trainer is
    built from the same folder (``hf_checkpoint``) and publishes bfloat16; its run defaults yield to flags. No
    model is loaded: the trainer's shape comes from the folder's config.json alone."""
    from launcher.model import MODELS_DIR, prepare_model

    (tiny,), _ = parse([])
    assert tiny.model == "tiny" and tiny.model_dir == MODELS_DIR / "tiny-llama" and tiny.reward == "digits"
    stores = ["grpc://127.0.0.1:1"]
    assert train_config(tiny, trainer_model(300), stores).publish_dtype == "params"

    folder = tmp_path / "smollm2-135m-instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True}))
    (cfg,), _ = parse(["--model", "smollm2-135m", "--model-dir", str(folder), "--max-tokens", "48"])
    assert cfg.model == "smollm2-135m" and cfg.model_dir == folder
    assert cfg.reward == "exact" and cfg.max_tokens == 48 and cfg.optim.lr == 1e-5  # a flag beats the default
    # make run's geometry (B=4, K=2, one rank, 12 train batches); the rest of the admission keeps the run's defaults
    assert (cfg.admission.train_batch_groups, cfg.admission.dp_ranks, cfg.train_batches) == (4, 1, 12)
    assert (cfg.admission.group_size, cfg.admission.mini_batches, cfg.admission.token_budget) == (4, 2, 4096)
    (default_dir,), _ = parse(["--model", "smollm2-135m"])
    assert default_dir.model_dir == MODELS_DIR / "smollm2-135m-instruct" and default_dir.max_tokens == 32
    (wider,), _ = parse(["--model", "smollm2-135m", "--train-batch-groups", "8", "--quick"])
    assert wider.admission.dp_ranks == 1 and wider.train_batches == 3  # a flag and --quick over the defaults
    assert wider.admission.quota_counts() == [{"add_small": 4, "add_large": 4}]

    model = prepare_model(cfg.model_path, model=cfg.model)  # a folder with config.json is used as it is
    assert model.hf_checkpoint == str(folder) and model.num_layers == 30 and model.vocab_size == 49152
    trainer = documents.load(TrainConfig, documents.dump(train_config(cfg, model, stores)))
    assert trainer.model.hf_checkpoint == str(folder) and trainer.publish_dtype == "bfloat16"
    rollout = documents.load(RolloutConfig, documents.dump(rollout_config(cfg, stores)))
    assert rollout.model == str(folder) and rollout.chat_template and rollout.reward == "exact"
    assert rollout.max_tokens == 48
    # the sources it can learn from, and each train batch's quota follows that mix
    assert rollout.data_sources == {"add_small": 0.5, "add_large": 0.5}
    assert cfg.admission.quota_counts() == [{"add_small": 2, "add_large": 2}]
    assert rollout_config(tiny, stores).data_sources == {"add_small": 0.5, "mul_large": 0.5}
    assert tiny.admission.quota_counts() == [{"add_small": 4, "mul_large": 4}]


def test_knit_run_source_mix_sets_the_quota_and_a_mix_b_cannot_split_is_refused() -> None:
    (cfg,), _ = parse(["--data-sources", "add_small=0.75,mul_large=0.25"])
    assert cfg.admission.quota_counts() == [{"add_small": 6, "mul_large": 2}]
    assert rollout_config(cfg, ["grpc://127.0.0.1:1"]).data_sources == {"add_small": 0.75, "mul_large": 0.25}
    with pytest.raises(SystemExit):  # 8 * 0.3 groups is not a whole number: refused before anything starts
        parse(["--data-sources", "add_small=0.7,mul_large=0.3"])


def test_flags_name_the_bad_value_and_keep_untouched_fields() -> None:
    parser = argparse.ArgumentParser()
    flags = add_flags(parser, TrainConfig)
    with pytest.raises(ValueError, match="--max-steps"):
        build(TrainConfig, flags, parser.parse_args(["--stores", "a", "--max-steps", "x", "--train-batch-groups", "2",
                                                     "--group-size", "2"]))
    base = TrainConfig(stores=["a"], max_steps=9, admission=AdmissionConfig(train_batch_groups=2, group_size=2))
    got = build(TrainConfig, flags, parser.parse_args(["--lr", "0.5", "--clip-high", "0.3"]), base=base)
    assert got.max_steps == 9 and got.optim.lr == 0.5 and got.admission.grpo.clip_high == 0.3
    assert dataclasses.replace(got, optim=base.optim, admission=base.admission) == base


def test_knit_train_refuses_a_bad_document_naming_the_field(tmp_path: Path) -> None:
    doc = tmp_path / "train.json"
    doc.write_text(json.dumps({"stores": ["grpc://127.0.0.1:1"], "max_steps": "five"}))
    res = subprocess.run([sys.executable, "-m", "launcher", "train", "--config", str(doc)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 2 and "max_steps" in res.stderr


def test_the_driver_imports_neither_vllm_nor_torch() -> None:
    code = ("import sys, launcher.cli, launcher.run, launcher.main_job, launcher.report, launcher.progress, "
            "launcher.model; print(sorted({'vllm', 'torch', 'megatron'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_demo_runs_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--groups", "9", "--group-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "2 store nodes, 27 trajectories in 9 groups" in out
    assert "fetched micro-batch: 6 rows" in out and "released 2 groups" in out
    for source in ("math", "code", "chat"):
        assert source in out


def test_flight_store_imports_no_heavy_package() -> None:
    code = ("import sys, flight_store, flight_store.node, flight_store.query; "
            "heavy = {'torch', 'admission', 'train', 'connectors', 'vllm', 'megatron', 'launcher'}; "
            "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# ---- processes and the report -------------------------------------------------------------------


def test_children_stop_their_whole_process_group(tmp_path: Path) -> None:
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print(p.pid, flush=True); time.sleep(60)")
    kids = Children(tmp_path / "logs")
    child = kids.start("sleeper", [sys.executable, "-c", code])
    log = tmp_path / "logs" / "sleeper.log"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not log.read_text().strip():
        time.sleep(0.1)
    grandchild = int(log.read_text().split()[0])
    assert os.getpgid(grandchild) == child.pid  # the grandchild is in the child's group
    kids.stop_all()
    assert not child.alive()
    time.sleep(0.2)
    try:  # gone, or a zombie waiting for its new parent to reap it
        state = Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z")
    assert json.loads((tmp_path / "logs" / "children.json").read_text())[0]["pid"] == child.pid


def _fake_run(folder: Path, arch: list[int], rewards: list[float]) -> None:
    """A run folder as the trainer writes it: 2 ranks, 2 steps, one micro-batch each."""
    folder.mkdir(parents=True)
    n = len(arch)
    consumed = pl.DataFrame({"group_id": [f"g{i // 2}" for i in range(n)], "sample_idx": [i % 2 for i in range(n)],
                             "step": [i * 2 // n for i in range(n)], "train_batch": [0] * n,
                             "response_len": [10] * n, "reward": rewards, "arch_staleness": arch,
                             "signed_staleness": arch})
    consumed.write_parquet(folder / "consumed.parquet")
    for rank in (0, 1):
        steps = [{"step": s, "train_batch": 0, "position": s, "version": s + 1, "loss": 0.1, "rows": n // 2,
                  "abs_logp_diff": 1e-7,
                  "fetch_s": [0.01], "exposed_wait_s": [0.002], "bytes_fetched": 1000, "step_time_s": 0.5,
                  "publish_s": 0.05, "plan_wait_s": 1.0, "t_end": 100.0 + s, "is_weight_mean": 1.0 + s,
                  "is_weight_max": 2.0 + s, "token_staleness_mean": 0.5 * s, "token_staleness_max": s}
                 for s in (0, 1)]
        rows = [["row", i * 2 // n, f"g{i // 2}", i % 2] for i in range(n) if (i // 2) % 2 == rank]
        (folder / f"trainer_rank{rank}.json").write_text(json.dumps({"env": {"rank": rank}, "steps": steps,
                                                                     "consumed": rows}))


def test_report_from_a_run_folder(tmp_path: Path) -> None:
    _fake_run(tmp_path / "train_batch", [2, 2, 2, 2], [0.0, 1.0, 0.5, 0.5])
    _fake_run(tmp_path / "mini_batch", [0, 0, 1, 1], [0.0, 1.0, 0.5, 0.5])
    results = {}
    for name in ("train_batch", "mini_batch"):
        r = policy_summary(tmp_path / name, config={"policy": name, "loss": {"objective": "tis"}}, wall_s=3.0)
        assert r.offpolicy.model_dump() == {"objective": "tis", "is_weight_mean": 1.5, "is_weight_max": 3.0,
                                            "is_truncated_frac": None, "clip_frac": None, "kl_behaviour_k3": None,
                                            "token_staleness_mean": 0.25, "token_staleness_max": 1.0}
        assert r.trajectories_consumed == 4 and r.rows_received == 4 and r.duplicate_rows == 0
        assert r.bytes_per_rank == {"0": 2000, "1": 2000}
        assert r.driver_payload_bytes == 0
        assert r.trainer_idle_s == 1.0  # step 0's wait is start-up
        assert r.training_window_s == pytest.approx(1.5)
        assert r.reward_per_train_batch == [0.5]
        assert len(table_rows(r)) > 10
        results[name] = r
    assert results["mini_batch"].arch_staleness_mean == 0.5 and results["mini_batch"].arch_staleness_max == 1
    doc = write_summary(tmp_path, results)
    assert doc.arch_staleness_reduction == 0.75
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["policies"]["train_batch"]["arch_staleness_mean"] == 2.0
    assert (tmp_path / "staleness_compare.png").stat().st_size > 1000
    assert (tmp_path / "reward_compare.png").stat().st_size > 1000
    window = results["mini_batch"].reward_first5
    assert window is not None and window.mean == 0.5 and window.train_batches == 1
    assert window.ci95 == pytest.approx(1.96 * float(pl.Series([0.0, 1.0, 0.5, 0.5]).std()) / 2, abs=1e-4)
    assert results["mini_batch"].reward_ci95_per_train_batch == [round(window.ci95, 4)]

    from launcher.report import plot_policy

    paths = plot_policy(tmp_path / "mini_batch", results["mini_batch"])
    assert [p.name for p in paths] == ["staleness_per_step.png", "time_breakdown.png", "reward_per_train_batch.png",
                                       "offpolicy_per_step.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_quota_violations_counts_train_batches_off_their_quota() -> None:
    from launcher.report import quota_violations

    consumed = pl.DataFrame({
        "train_batch": [0, 0, 0, 0, 1, 1, 1, 1, 1],
        "group_id": ["a", "a", "b", "c", "d", "e", "f", "g", "g"],  # rows; groups counted once
        "data_source": ["math", "math", "chat", "chat", "math", "math", "math", "chat", "chat"],
    })
    quota = [("data_source", {"math": 1, "chat": 2})]
    assert quota_violations(consumed, quota) == 2  # batch 1: 3 math, 1 chat; batch 0 keeps 1 + 2
    assert quota_violations(consumed.filter(pl.col("train_batch") == 0), quota) == 0
    assert quota_violations(consumed, []) == 0
