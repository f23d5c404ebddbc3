"""Break what a test guards and watch the test fail: each entry edits one line of a scratch copy of this tree, runs
the tests that guard it there, and reports whether they failed (they must).

    python tests/support/break_checks.py            # every entry, a few minutes on 2 cores
    python tests/support/break_checks.py 0 5        # entries by number

Not part of the suite (it runs the suite's own tests against broken code); run it after changing a guarded piece or
its test. Each entry's tests run on the unbroken scratch tree first: one that fails there is reported ("FAILS
UNBROKEN") and not counted. A line that reads "CANNOT FAIL?" is a test that passed with its guard broken.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (what is broken, file, the exact text, what it becomes, the tests that must fail). A text of None: flip the first
# ColwiseParallel() of the file to RowwiseParallel().
MUTATIONS = [
    ("sampled_checksum: float32 linspace indices (the src_data_rank=None bug)", "surgery/parallel/agreement.py",
        "    index = steps * (n - 1) // max(k - 1, 1)\n", "    index = torch.linspace(0, n - 1, k).long()\n",
        ["tests/families/test_published_width.py::PublishedWidth::test_flux2_dev"]),
    ("copy_from_source: weights past 2**24 elements not sent from the source rank", "surgery/parallel/tensor_parallel.py",
        "                    if isinstance(sharded, DTensor) and sharded.placements[0].is_shard():\n",
        "                    if isinstance(sharded, DTensor) and sharded.placements[0].is_shard() and whole.numel() <= 2**24:\n",
        ["tests/families/test_family_width.py::test_world_2_bria"]),
    ("published-width float64 rule: a gradient 3e-4 off passes as rounding", "tests/workers/family_width_worker.py",
        "        kept[name] = grad.to_local() if isinstance(grad, DTensor) else grad\n",
        "        kept[name] = (grad.to_local() if isinstance(grad, DTensor) else grad) * (1 + 3e-4)\n",
        ["tests/families/test_family_width.py::test_world_2_wan_animate"]),
    ("published-width seeding: an empty matrix scaled by its zero fan-in (Krea2's text-fusion projector, 1 x 0)",
        "tests/workers/published_width_worker.py",
        "period if name in scaled or n == 0 else", "period if name in scaled else",
        ["tests/families/test_family_width.py::test_world_2_krea2"]),
    ("shared SplitProjection plan: attn part replicated output", "surgery/core/split_projection.py",
        "    ATTN_PART: RowwiseParallel(output_layouts=Partial(), use_local_output=False),\n",
        "    ATTN_PART: RowwiseParallel(use_local_output=False),\n",
        ["tests/families/test_conformance.py::TensorParallel::test_world_4",
         "tests/families/test_conformance.py::TensorParallel::test_matches_single_device_fused_model_2_flux2_tp_wide"]),
    ("TP x FSDP2 AdamW: the sharded step skipped", "tests/workers/two_d_worker.py",
        "        grads, params = train_step(model, local_kw, local_target, cls, **opts)\n",
        "        grads, params = train_step(model, local_kw, local_target, cls, **dict(opts, lr=0.0))\n",
        ["tests/parallel/test_two_d_mesh.py::TensorTimesFSDP2::test_an_adamw_step_matches_one_device"]),
    ("atomic swap: delete then rename instead of the exchange", "surgery/io/atomic.py",
        "    if _renameat2(staged, target, _RENAME_EXCHANGE):\n        return staged\n",
        "    if True:\n        shutil.rmtree(target)\n        os.rename(staged, target)\n        return None\n",
        ["tests/io/test_atomic_save.py::NeverAbsent::test_the_destination_is_whole_at_every_step_of_the_swap"]),
    ("plans-only: the shared attention plan QwenImage uses changed", "rewrites/diffusers_common.py",
        None, None, ["tests/families/test_conformance.py::PlansOnly"]),
    ("copy_from_source: already-sharded parameters not skipped (the pipeline hang)", "surgery/parallel/tensor_parallel.py",
        "                if original is None or original is param:\n",
        "                if False:\n",
        ["tests/parallel/test_pipelines.py::KleinPipeline::test_tensor_parallel_over_two_ranks_gives_the_single_device_image"]),
    ("tensor_parallel: blocks' unsharded parameters never released", "surgery/parallel/tensor_parallel.py",
        "        saved.release()\n        done.append(saved)\n", "        done.append(saved)\n",
        ["tests/families/test_published_width.py::PublishedWidth::test_hunyuan_video_t2v"]),
    ("LoRA on TP x FSDP2: single block's leaves not targeted", "tests/workers/two_d_worker.py",
        r'''r"single_transformer_blocks\.0\.attn\.(to_qkv_mlp_proj\.(q|k|v|gate|up)|to_out\.(attn_part|mlp_part)))")''',
        r'''r"single_transformer_blocks\.0\.attn\.(to_[qkv]|to_out|mlp\.linear_\w+))")''',
        ["tests/parallel/test_two_d_mesh.py::LoRAOnTensorTimesFSDP2"]),
    ("tensor_parallel: a collective before the ranks agree", "surgery/parallel/tensor_parallel.py",
        "    planned = agree(mesh, \"tensor_parallel\", check,",
        "    dist.barrier(group=mesh.get_group())\n    planned = agree(mesh, \"tensor_parallel\", check,",
        ["tests/parallel/test_rank_agreement.py::Agreement::test_a_refusal_runs_no_collective_but_the_agreement"]),
    ("agreement: ranks in different verbs not told", "surgery/parallel/agreement.py",
        "    if message is None and len(set(verbs)) > 1:\n", "    if False:\n",
        ["tests/parallel/test_rank_agreement.py::Agreement::test_ranks_in_different_verbs_name_each_other"]),
    ("stock_lora_adapter: parts' different scales not folded into lora_B", "surgery/integration/lora.py",
        "        if len({scale[p] for p in present}) > 1:", "        if False:",
        ["tests/integration/test_diffusers_lora.py::AdapterWhosePartsScaleDifferently::test_parts_with_their_own_alpha",
         "tests/integration/test_diffusers_lora.py::AdapterWhosePartsScaleDifferently::test_parts_with_their_own_rank"]),
    ("stock_lora_adapter: rsLoRA's alpha computed as plain LoRA's", "surgery/integration/lora.py",
        '(math.sqrt(rank) if config.get("use_rslora") else rank)', "rank",
        ["tests/integration/test_diffusers_lora.py::AdapterWhosePartsScaleDifferently::test_rslora"]),
    ("checks: accelerate's hooks (device_map, CPU offloading) not refused", "surgery/core/checks.py",
        '    if getattr(module, "_hf_hook", None) is not None:\n', "    if False:\n",
        ["tests/core/test_bad_input.py::Refusals::test_accelerate_offloading_hooks",
         "tests/core/test_bad_input.py::AlreadySharded::test_accelerate_offloading_hooks_under_tensor_parallel"]),
    ("shard_lora: no handshake (a rank alone waits in the first broadcast)", "surgery/integration/lora_tp.py",
        'agree(mesh, "lora.shard_lora", lambda: _adapter_layers(model, styles), weights)', "_adapter_layers(model, styles)",
        ["tests/parallel/test_rank_agreement.py::Agreement::test_shard_lora_on_one_rank_raises_there_naming_the_other"]),
    ("add_adapter: DoRA on a sharded model not refused (PEFT's mixed Tensor/DTensor error)",
        "surgery/integration/diffusers_hooks.py",
        'if getattr(adapter_config, "use_dora", False) and any(', "if False and any(",
        ["tests/integration/test_lora_tp.py::AdaptersOnAShardedModel::test_bad_adapters_are_refused_on_every_rank_and_change_nothing"]),
    ("save_lora_adapter (sharded): ranks' different folders not refused", "surgery/integration/lora_tp.py",
        "    if len(set(folders)) > 1:", "    if False:",
        ["tests/io/test_save_faults.py::SaveFaults::test_every_rank_raises_at_once_and_nothing_is_left_behind"]),
    ("load_lora_adapter (sharded): ranks' different adapter names not refused", "surgery/integration/lora_tp.py",
        "    if len(set(names)) > 1:", "    if False:",
        ["tests/io/test_save_faults.py::SaveFaults::test_every_rank_raises_at_once_and_nothing_is_left_behind"]),
    ("FLUX.2 plan: the feed-forward's up rows left whole", "rewrites/flux2.py",
        '    "linear_in.up": ColwiseParallel(),\n', "",
        ["tests/parallel/test_tensor_parallel.py::Cost::test_per_rank_bytes_are_replicated_plus_sharded_over_world_0"]),
    ("feature tests: the test's own exceptions turned into skips", "tests/integration/test_diffusers_features.py",
        "            raise  # the test's own mistake, not stock's refusal\n", "            pass\n",
        ["tests/integration/test_diffusers_features.py::test_on_stock_skips_for_stock_refusals_only"]),
    ("TP save: the high-water mark not reset after the model's build (the save's peak unseen)", "tests/workers/save_worker.py",
        '        clear.write("5")\n', '        clear.write("")\n',
        ["tests/io/test_save_load.py::SaveMemory::test_each_rank_holds_about_one_or_two_tensors_not_its_shard"]),
    # issue 41, refused early and said why
    ("unfuse: an inference tensor refused inside inference_mode too (stock works there)", "surgery/core/checks.py",
        "    if param.is_inference() and not torch.is_inference_mode_enabled():", "    if param.is_inference():",
        ["tests/core/test_inference_mode.py::InsideInferenceMode"]),
    ("GGUF: a type diffusers cannot dequantize (Q8_1, I8) not refused at load", "surgery/io/sliced_files.py",
        "            if t.quantized and not dequantizable(t.ggml_type):", "            if False:",
        ["tests/io/test_refused_files.py::GGUFTypesDiffusersCannotRead"]),
    ("safetensors header: a header size past the file read anyway (MemoryError)", "surgery/io/sliced_files.py",
        "                if size > length - 8:", "                if False:",
        ["tests/io/test_refused_files.py::MalformedSafetensorsHeader"]),
    ("safetensors header: an entry's missing keys not named", "surgery/io/sliced_files.py",
        '    for key in ("dtype", "shape", "data_offsets"):', "    for key in ():",
        ["tests/io/test_refused_files.py::MalformedSafetensorsHeader"]),
    ("plan=/filter_fn: half a planned module not refused", "surgery/parallel/plans.py",
        "        if have and missing:", "        if False:", ["tests/parallel/test_half_units.py"]),
    ("tensor_parallel_pipeline: a component sharded before the transformer is checked", "surgery/parallel/pipeline.py",
        '            planned.append((component, plan_component(name, component, mesh.size(), required=name == "transformer")))',
        '            planned.append((None, _shard(plan_component(name, component, mesh.size(), required=name == "transformer"), component, mesh, src_data_rank)))',
        ["tests/parallel/test_pipeline_refusal.py"]),
    ("tensor_parallel_pipeline: components unfused for the check not fused back", "surgery/parallel/pipeline.py",
        '            if row.get("unfused"):\n                fuse(component)', "            pass",
        ["tests/parallel/test_pipeline_refusal.py::RefusedTransformer"]),
    ("CLI: a mesh size unbounded (a 23-digit --tp reaches torch)", "surgery/app/cli.py",
        '_ranks = _between(1, 2**16, "ranks of a mesh")', '_ranks = _between(1, 10**30, "ranks of a mesh")',
        ["tests/app/test_cli_hostile.py::HostileArguments::test_usage_errors_exit_two_with_the_reason_last_00_plan_tp_"
         "99999999999999999999999"]),
    ("CLI: an unforeseen error printed as a traceback", "surgery/app/cli.py",
        "    except Exception as error:  # noqa: BLE001 - a command line never ends",
        "    except ZeroDivisionError as error:  # noqa: BLE001 - a command line never ends",
        ["tests/app/test_cli_hostile.py::HostileArguments::test_an_unforeseen_error_is_one_line_naming_itself_a_bug"]),
    ("config: sizes past any model built anyway", "surgery/core/build.py",
        "        if value > most:", "        if False:",
        # (not the num_layers=1e30 case: broken, it builds layers forever)
        ["tests/app/test_cli_hostile.py::HostileArguments::test_refusals_exit_one_with_one_line_05_plan_tp_2_config_TMP_config2_json"]),
    ("save_pretrained: a quantized weight written (fails inside the write)", "surgery/io/saving.py",
        "    _check_plain(model)\n", "", ["tests/io/test_quantized_save.py"]),
    ("save_lora_adapter (sharded): the adapter name checked by diffusers on one rank, before the ranks agree",
        "surgery/integration/diffusers_hooks.py",
        "    if saving.is_sharded(self):  # every check there",
        '    if adapter_name not in getattr(self, "peft_config", {}):\n        raise ValueError("not found")\n'
        "    if saving.is_sharded(self):  # every check there",
        ["tests/io/test_save_faults.py::SaveFaults::test_every_rank_raises_at_once_and_nothing_is_left_behind"]),
    ("save_lora_adapter (sharded): ranks' different adapter names not refused", "surgery/integration/lora_tp.py",
        "    if len(set(names)) > 1:  # each rank would gather", "    if False:  # each rank would gather",
        ["tests/io/test_save_faults.py::SaveFaults::test_every_rank_raises_at_once_and_nothing_is_left_behind"]),
    ("atomic save: the staged folder's mode left at mkdtemp's 0o700", "surgery/io/atomic.py",
        "            os.chmod(staged, (target.stat().st_mode & 0o7777) if target.exists() else 0o777 & ~_umask())\n", "",
        ["tests/io/test_atomic_mode.py"]),
    ("docs: a name that does not exist (the old usage.md's surgery.extend.tp_plans)", "docs/usage.md",
        "`surgery.extend.families()`", "`surgery.extend.tp_plans()`", ["tests/app/test_docs_names.py"]),
    ("copy_shard: a strided shard (weights stored transposed) received in place", "surgery/parallel/tensor_parallel.py",
        "    local = shard if shard.is_contiguous() else torch.empty(shard.shape, dtype=shard.dtype, device=shard.device)\n",
        "    local = shard\n",
        ["tests/parallel/test_rank_inputs.py::TransposedStorage"]),
    ("lock file: a planted link followed", "surgery/io/atomic.py",
        "os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW", "os.O_RDWR | os.O_CREAT",
        ["tests/io/test_lock_file.py::PlantedLock::test_a_link_is_never_followed"]),
    ("save_pretrained: a torch.compile'd model saved with its _orig_mod. keys", "surgery/io/saving.py",
        "    model = unwrap_module(model)", "    pass",
        ["tests/io/test_compiled_save.py"]),
    ("safetensors header: a tensor's start not checked against where the one before it ends", "surgery/io/sliced_files.py",
        "        if begin != end or stop - begin != expected:\n", "        if stop - begin != expected:\n",
        ["tests/io/test_safetensors_header.py"]),
    ("stock_lora_adapter: set_adapters' weight saved into the alphas", "surgery/integration/lora.py",
        "name: layer.lora_alpha[adapter_name] / (", "name: float(layer.scaling[adapter_name]) + 0 * (",
        ["tests/integration/test_adapter_save_weights.py"]),
    ("filter_fn: a q/k norm kept whole beside its sharded projections not refused", "surgery/parallel/plans.py",
        "        if have and missing:", "        if False:",
        ["tests/parallel/test_rank_inputs.py::FilterKeepsHeadNormsWhole"]),
    ("processor check: a wrapper's held processor not followed", "surgery/parallel/derive.py",
        '    for name, value in getattr(processor, "__dict__", {}).items():', "    for name, value in {}.items():",
        ["tests/parallel/test_wrapped_processors.py::WrappedOrDerivedProcessors::test_refused_by_name_before_anything_changes_0_sana"]),
    ("processor check: only the class's own __call__ read, not its MRO's", "surgery/parallel/derive.py",
        'for cls in type(processor).__mro__ if "__call__" in vars(cls)]',
        'for cls in type(processor).__mro__[:1] if "__call__" in vars(cls)]',
        ["tests/parallel/test_wrapped_processors.py::WrappedOrDerivedProcessors::test_refused_by_name_before_anything_changes_0_sana"]),
    ("load_tensor_parallel: the files the ranks read not compared", "surgery/io/loading.py",
        "weights=False, files=files)", "weights=False, files=None)",
        ["tests/parallel/test_rank_inputs.py::RanksGivenDifferentData::test_every_rank_raises_the_same_error_naming_the_file"]),
    ("load_lora_adapter (sharded): the adapter the ranks read not compared", "surgery/integration/lora_tp.py",
        'lambda checked: {"files": checked[3]})', "lambda checked: {})",
        ["tests/parallel/test_rank_inputs.py::RanksGivenDifferentData::test_every_rank_raises_the_same_error_naming_the_file"]),
    ("shard_lora(src_data_rank=None): the ranks' starting factors not compared", "surgery/integration/lora_tp.py",
        "weights = partial(_factor_checksums, model) if src_data_rank is None else None", "weights = None",
        ["tests/parallel/test_rank_inputs.py::RanksGivenDifferentData::test_every_rank_raises_the_same_error_naming_the_file"]),
]


def _pytest(tree: Path, tests: list[str]) -> subprocess.CompletedProcess:
    # the scratch tree first on the path (an editable install would import this tree otherwise); a hang in a rank job
    # fails within 300 s (the LoRA-under-TP job alone takes over 90 s on a busy machine)
    env = dict(os.environ, PYTHONPATH=str(tree), SURGERY_RANKS_TIMEOUT="300")
    # every named test, the heavy tier too (pyproject leaves it out by default)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "heavy or not heavy",
                           *tests], cwd=tree,
                          env=env, capture_output=True, text=True)


def _last(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stdout.splitlines() if line.strip()][-1:]


def main(argv: list[str]) -> int:
    chosen = [int(a) for a in argv] or range(len(MUTATIONS))
    passed, unusable = [], []
    for i in chosen:
        what, path, old, new, tests = MUTATIONS[i]
        with tempfile.TemporaryDirectory(prefix="surgery-break-") as tmp:
            tree = Path(tmp) / "tree"
            shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info"))
            # the families install as `surgery_rewrites`: the scratch tree's own, not the editable install's
            (tree / "surgery_rewrites").symlink_to(tree / "rewrites", target_is_directory=True)
            target = tree / path
            text = target.read_text()
            if old is None:
                old, new = "ColwiseParallel()", "RowwiseParallel()"
            if old not in text:
                print(f"{i} | {what} | the text to break is no longer in {path}: update this entry", flush=True)
                unusable.append(i)
                continue
            started = time.time()
            # unbroken first: a test that fails (or selects nothing) on the good code proves nothing when it fails
            # on the broken one, so it is reported and not counted
            clean = _pytest(tree, tests)
            if clean.returncode != 0:
                print(f"{i} | {what} | {' '.join(tests)} | FAILS UNBROKEN (exit {clean.returncode}), not counted | "
                      f"{_last(clean)} | {time.time() - started:.0f} s", flush=True)
                unusable.append(i)
                continue
            target.write_text(text.replace(old, new, 1))
            run = _pytest(tree, tests)
        verdict = "failed, as it must" if run.returncode == 1 else f"exit {run.returncode}: CANNOT FAIL?"
        if run.returncode != 1:
            passed.append(i)
        print(f"{i} | {what} | {' '.join(tests)} | passed unbroken, {verdict} | {_last(run)} | "
              f"{time.time() - started:.0f} s", flush=True)
    return 1 if passed or unusable else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
