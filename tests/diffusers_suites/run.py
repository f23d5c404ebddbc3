"""Run diffusers' own model, pipeline and LoRA test files for every supported family, stock and unfused.

    python tests/diffusers_suites/run.py --diffusers PATH [--family flux1 ...] [--kind model pipeline lora]
                                         [--timeout 900] [--out results.json] [-k EXPR] [--streams-off]

PATH is a checkout of diffusers' repository (its `tests/` folder; the PyPI package ships none). Each file runs twice in
its own pytest process (`-p plugin`, see plugin.py): once stock, once with `--surgery-unfuse`. The table gives
passed / failed / skipped per file and run, and lists every test that passes stock but fails unfused. Failures that
need the Hub (no network here) are counted apart. Not part of CI: diffusers' tests are not installed there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent

# family -> test files (relative to the diffusers checkout), by kind. Files whose model class is not the family's
# (FramePack, HunyuanDiT) are left out.
FILES = {
    "flux2": {
        "model": ["tests/models/transformers/test_models_transformer_flux2.py"],
        "pipeline": ["tests/pipelines/flux2/test_pipeline_flux2.py", "tests/pipelines/flux2/test_pipeline_flux2_klein.py",
                     "tests/pipelines/flux2/test_pipeline_flux2_klein_inpaint.py",
                     "tests/pipelines/flux2/test_pipeline_flux2_klein_kv.py"],
        "lora": ["tests/lora/test_lora_layers_flux2.py"],
    },
    "flux1": {
        "model": ["tests/models/transformers/test_models_transformer_flux.py"],
        "pipeline": [f"tests/pipelines/flux/test_pipeline_flux{s}.py" for s in
                     ("", "_control", "_control_img2img", "_control_inpaint", "_fill", "_img2img", "_inpaint",
                      "_kontext", "_kontext_inpaint")],
        "lora": ["tests/lora/test_lora_layers_flux.py"],
    },
    "chroma": {
        "model": ["tests/models/transformers/test_models_transformer_chroma.py"],
        "pipeline": ["tests/pipelines/chroma/test_pipeline_chroma.py",
                     "tests/pipelines/chroma/test_pipeline_chroma_img2img.py"],
    },
    "hunyuan-video": {
        "model": ["tests/models/transformers/test_models_transformer_hunyuan_video.py"],
        "pipeline": ["tests/pipelines/hunyuan_video/test_hunyuan_video.py",
                     "tests/pipelines/hunyuan_video/test_hunyuan_image2video.py",
                     "tests/pipelines/hunyuan_video/test_hunyuan_skyreels_image2video.py"],
        "lora": ["tests/lora/test_lora_layers_hunyuanvideo.py"],
    },
    "wan": {
        "model": ["tests/models/transformers/test_models_transformer_wan.py"],
        "pipeline": ["tests/pipelines/wan/test_wan.py", "tests/pipelines/wan/test_wan_image_to_video.py"],
        "lora": ["tests/lora/test_lora_layers_wan.py"],
    },
    "skyreels-v2": {"model": ["tests/models/transformers/test_models_transformer_skyreels_v2.py"]},
    "wan-vace": {"model": ["tests/models/transformers/test_models_transformer_wan_vace.py"]},
    "sd3": {"model": ["tests/models/transformers/test_models_transformer_sd3.py"]},
    "cogvideox": {"model": ["tests/models/transformers/test_models_transformer_cogvideox.py"]},
    "pixart": {"model": ["tests/models/transformers/test_models_pixart_transformer2d.py"]},
    "dit": {"model": ["tests/models/transformers/test_models_dit_transformer2d.py"]},
    "cogview3-plus": {"model": ["tests/models/transformers/test_models_transformer_cogview3plus.py"]},
    "cogview4": {"model": ["tests/models/transformers/test_models_transformer_cogview4.py"]},
    "z-image": {"model": ["tests/models/transformers/test_models_transformer_z_image.py"]},
    "hunyuan-video-1.5": {"model": ["tests/models/transformers/test_models_transformer_hunyuan_1_5.py"]},
    "chronoedit": {"model": ["tests/models/transformers/test_models_transformer_chronoedit.py"]},
    "helios": {"model": ["tests/models/transformers/test_models_transformer_helios.py"]},
    "wan-animate": {"model": ["tests/models/transformers/test_models_transformer_wan_animate.py"]},
    "wan-animate-2": {"model": ["tests/models/transformers/test_models_transformer_wan_animate_2.py"]},
    "ltx-video": {"model": ["tests/models/transformers/test_models_transformer_ltx.py"]},
    "ltx-2": {"model": ["tests/models/transformers/test_models_transformer_ltx2.py"]},
    "cosmos": {"model": ["tests/models/transformers/test_models_transformer_cosmos.py"]},
    "auraflow": {"model": ["tests/models/transformers/test_models_transformer_aura_flow.py"]},
    "consisid": {"model": ["tests/models/transformers/test_models_transformer_consisid.py"]},
    "allegro": {"model": ["tests/models/transformers/test_models_transformer_allegro.py"]},
    "glm-image": {"model": ["tests/models/transformers/test_models_transformer_glm_image.py"]},
    "ernie-image": {"model": ["tests/models/transformers/test_models_transformer_ernie_image.py"]},
    "anyflow": {"model": ["tests/models/transformers/test_models_transformer_anyflow.py"]},
    "prior": {"model": ["tests/models/transformers/test_models_prior.py"]},
    "hunyuan-video-framepack": {"model": ["tests/models/transformers/test_models_transformer_hunyuan_video_framepack.py"]},
    "hunyuan-dit": {"model": ["tests/models/transformers/test_models_transformer_hunyuan_dit.py"]},
    "latte": {"model": ["tests/models/transformers/test_models_transformer_latte.py"]},
    "lumina-next": {"model": ["tests/models/transformers/test_models_transformer_lumina.py"]},
    "easyanimate": {"model": ["tests/models/transformers/test_models_transformer_easyanimate.py"]},
    "omnigen": {"model": ["tests/models/transformers/test_models_transformer_omnigen.py"]},
    "hunyuan-image": {"pipeline": ["tests/pipelines/hunyuan_image_21/test_hunyuanimage.py"]},
    "longcat-image": {"model": ["tests/models/transformers/test_models_transformer_longcat_image.py"]},
    "motif-video": {
        "model": ["tests/models/transformers/test_models_transformer_motif_video.py"],
        "pipeline": ["tests/pipelines/motif_video/test_motif_video.py",
                     "tests/pipelines/motif_video/test_motif_video_image2video.py"],
    },
    "ovis-image": {
        "model": ["tests/models/transformers/test_models_transformer_ovis_image.py"],
        "pipeline": ["tests/pipelines/ovis_image/test_ovis_image.py"],
    },
    "bria": {
        "model": ["tests/models/transformers/test_models_transformer_bria.py"],
        "pipeline": ["tests/pipelines/bria/test_pipeline_bria.py"],
    },
    "bria-fibo": {
        "model": ["tests/models/transformers/test_models_transformer_bria_fibo.py"],
        "pipeline": ["tests/pipelines/bria_fibo/test_pipeline_bria_fibo.py",
                     "tests/pipelines/bria_fibo_edit/test_pipeline_bria_fibo_edit.py"],
    },
    "sana": {"model": ["tests/models/transformers/test_models_transformer_sana.py"]},
    "sana-video": {"model": ["tests/models/transformers/test_models_transformer_sana_video.py"]},
    "hidream": {"model": ["tests/models/transformers/test_models_transformer_hidream.py"]},
    "lumina2": {"model": ["tests/models/transformers/test_models_transformer_lumina2.py"]},
    "mochi": {"model": ["tests/models/transformers/test_models_transformer_mochi.py"]},
    "kandinsky5": {"pipeline": ["tests/pipelines/kandinsky5/test_kandinsky5.py"]},
    "krea2": {"model": ["tests/models/transformers/test_models_transformer_krea2.py"],
              "pipeline": ["tests/pipelines/krea2/test_krea2.py"]},
    "ideogram4": {"model": ["tests/models/transformers/test_models_transformer_ideogram4.py"]},
    "joyimage-edit": {"model": ["tests/models/transformers/test_models_transformer_joyimage.py"]},
    "joyimage-edit-plus": {"model": ["tests/models/transformers/test_models_transformer_joyimage_edit_plus.py"]},
    "minimax-h3": {"model": ["tests/models/transformers/test_models_transformer_minimax_h3.py"]},
    "prx": {"model": ["tests/models/transformers/test_models_transformer_prx.py"]},
    "stable-audio-3": {"model": ["tests/models/transformers/test_models_transformer_stable_audio3.py"]},
    "stable-audio": {"pipeline": ["tests/pipelines/stable_audio/test_stable_audio.py"]},
    "longcat-audio-dit": {"model": ["tests/models/transformers/test_models_transformer_longcat_audio_dit.py"]},
    "minimax-music3": {"model": ["tests/models/transformers/test_models_transformer_minimax_music3.py"]},
    "cosmos3": {"model": ["tests/models/transformers/test_models_transformer_cosmos3.py"]},
    "anyflow-far": {"model": ["tests/models/transformers/test_models_transformer_anyflow_far.py"]},
    "transformer-temporal": {"model": ["tests/models/transformers/test_models_transformer_temporal.py"]},
    "nucleusmoe-image": {"model": ["tests/models/transformers/test_models_transformer_nucleusmoe_image.py"]},
    # no model test file: the UNet's pipelines, whose DreamLiteTransformer2DModels are unfused as the UNet builds them
    "dreamlite": {"pipeline": ["tests/pipelines/dreamlite/test_pipeline_dreamlite.py",
                               "tests/pipelines/dreamlite/test_pipeline_dreamlite_mobile.py"]},
    # plans-only families: `unfuse` changes no module, so both runs must agree exactly (a check of the plugin)
    "ace-step": {"model": ["tests/models/transformers/test_models_transformer_ace_step.py"]},
    "qwen-image": {
        "model": ["tests/models/transformers/test_models_transformer_qwenimage.py"],
        "pipeline": ["tests/pipelines/qwenimage/test_qwenimage.py"],
        "lora": ["tests/lora/test_lora_layers_qwenimage.py"],
    },
}

HUB = re.compile(r"huggingface\.co|LocalEntryNotFound|offline mode|HF_HUB_OFFLINE|Cannot find the requested files|"
                 r"We couldn't connect|is not a local folder and is not a valid model identifier|"
                 r"Can't load .* for '[\w.-]+/[\w.-]+'|RepositoryNotFound|MaxRetryError|Failed to resolve|"
                 r"Network is unreachable|ConnectionError|does not appear to have a file named", re.I)


def run_file(diffusers: Path, test_file: str, unfused: bool, timeout: int, env: dict, extra: tuple = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="surgery-suite-") as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "plugin", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={xml}", *extra, test_file]
        if unfused:
            cmd.append("--surgery-unfuse")
        start = time.time()
        try:
            proc = subprocess.run(cmd, cwd=diffusers, env=env, capture_output=True, text=True, timeout=timeout)
            tail = proc.stdout[-2000:] + proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s", "seconds": timeout}
        result = {"seconds": round(time.time() - start, 1), "passed": [], "failed": {}, "skipped": 0, "hub": {}}
        if not os.path.exists(xml):
            result["error"] = tail
            return result
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                message = (bad.get("message") or "") + "\n" + (bad.text or "")
                short = (bad.get("message") or "").strip().splitlines()[0][:300] if bad.get("message") else ""
                (result["hub"] if HUB.search(message) else result["failed"])[name] = short
            elif case.find("skipped") is not None:
                result["skipped"] += 1
            else:
                result["passed"].append(name)
        return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diffusers", required=True, type=Path, help="a checkout of diffusers' repository")
    parser.add_argument("--family", nargs="*", default=list(FILES), choices=list(FILES))
    parser.add_argument("--kind", nargs="*", default=["model", "pipeline", "lora"], choices=["model", "pipeline", "lora"])
    parser.add_argument("--file", nargs="*", default=None, help="only these files (substrings of their paths)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per file and run")
    parser.add_argument("--out", type=Path, default=None, help="write every result as JSON here")
    parser.add_argument("-k", dest="select", default=None, help="only the tests pytest's -k expression selects")
    parser.add_argument("--streams-off", action="store_true",
                        help="group offloading without accelerator streams (the plugin's --surgery-streams-off)")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("SURGERY_STANDINS", tempfile.mkdtemp(prefix="surgery-standins-"))
    extra = (("-k", args.select) if args.select else ()) + (("--surgery-streams-off",) if args.streams_off else ())
    results = {}
    if args.out and args.out.exists():
        results = json.loads(args.out.read_text())
    for family in args.family:
        for kind in args.kind:
            for test_file in FILES[family].get(kind, []):
                if args.file and not any(f in test_file for f in args.file):
                    continue
                if not (args.diffusers / test_file).exists():
                    print(f"{family:14} {test_file}: not in this diffusers checkout", flush=True)
                    continue
                row = {"family": family, "kind": kind}
                for mode in ("stock", "unfused"):
                    row[mode] = run_file(args.diffusers, test_file, mode == "unfused", args.timeout, env, extra)
                results[test_file] = row
                print(line(test_file, row), flush=True)
                for name, why in regressions(row).items():
                    print(f"    unfused-only failure: {name}: {why}", flush=True)
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))
    return 0


def counts(result: dict) -> str:
    if "error" in result and not result.get("passed") and not result.get("failed"):
        return "error: " + result["error"].strip().splitlines()[-1][:120] if result["error"].strip() else "error"
    return (f"{len(result['passed'])} passed, {len(result['failed'])} failed, {result['skipped']} skipped"
            + (f", {len(result['hub'])} need the Hub" if result["hub"] else ""))


def regressions(row: dict) -> dict:
    stock, unfused = row["stock"], row["unfused"]
    if "passed" not in stock or "failed" not in unfused:
        return {}
    return {n: why for n, why in {**unfused["failed"], **unfused["hub"]}.items() if n in set(stock["passed"])}


def line(test_file: str, row: dict) -> str:
    return (f"{row['family']:14} {Path(test_file).name:48} stock: {counts(row['stock']):55} "
            f"unfused: {counts(row['unfused'])}")


if __name__ == "__main__":
    sys.exit(main())
