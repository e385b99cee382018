"""Learning dynamics: what a run's checkpoints do with one fixed probe batch, and how two runs'
compare.

    python tools/dynamics.py capture checkpoints/run     # each checkpoint: activations, gradients
    python tools/dynamics.py report checkpoints/run [--against checkpoints/other] [-o F.png]

`capture` reads every checkpoint of a run (`step_*/` in its --save_dir, of any step and layout:
the pieces put together as tools/export_hf.py does), builds the whole model on this process, and
runs the probe batch through it: the first --probe_rows rows of the run's validation data (its
dataset, tokenizer and seq_len, read from the run file `run.yaml` that the trainer wrote beside
the checkpoints). It writes `dynamics/step_000100.safetensors` in the run's folder: the probe's
token ids, the residual stream entering the first layer and after each layer, each sublayer's
output (attention, MLP), the loss, and the gradient of that loss for every parameter, all whole;
and the Gini and Hoyer sparsity of every weight. The tensors come from the checkpoint, so they are
the same however the run was sharded; a model must fit one process (every model of this course
does). A checkpoint already captured is skipped.

`report` computes, per layer, across the run (each checkpoint against the one before: how far the
representations moved) or against another run at the same steps (--against: whether two layouts
learned alike): linear CKA and PWCCA of the residual stream; the gradient norm, the cosine between
consecutive checkpoints' gradients; Gini and Hoyer sparsity of weights, activations and
gradients. It prints a table, and -o draws them (matplotlib: pip install -e ".[plot]").
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "step3_dataloader"))  # the trainer's own tokenizer and splits

from export_hf import export  # noqa: E402

from dataloader import load_data  # noqa: E402


### begin Metrics
def centered(x):
    """(n, d) with each column's mean removed: CKA and CCA compare how examples spread."""
    x = x.double().flatten(0, -2)  # (n, d): one row per token
    return x - x.mean(0, keepdim=True)


def linear_cka(x, y):
    """Linear CKA of two representations of the same n examples, (n, d) and (n, d'): 1 for the
    same up to a rotation and a scale, near 0 for unrelated ones (Kornblith et al., 2019)."""
    x, y = centered(x), centered(y)
    cross = (y.T @ x).pow(2).sum()
    return (cross / ((x.T @ x).norm() * (y.T @ y).norm())).item()


def orthonormal_basis(x, rtol=1e-10):
    """An orthonormal basis of the columns of x (n, d), without the directions x barely spans."""
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    return u[:, s > rtol * s.max()]


def pwcca(x, y):
    """Projection-weighted CCA (Morcos et al., 2018): the canonical correlations of x and y, each
    weighted by how much of x's neurons lie along its canonical direction. 1 for representations
    equal up to an invertible linear map."""
    x, y = centered(x), centered(y)
    qx, qy = orthonormal_basis(x), orthonormal_basis(y)
    u, rho, _ = torch.linalg.svd(qx.T @ qy, full_matrices=False)
    h = qx @ u  # (n, k): x's canonical variates, unit length
    weights = (h.T @ x).abs().sum(1)  # (k,): how much of x lies along each
    return ((weights * rho.clamp(max=1)).sum() / weights.sum()).item()


def gini(t):
    """Gini coefficient of |t| (Hurley and Rickard, 2009): 0 when every entry has the same size,
    1 - 1/N when one entry holds everything."""
    a = t.double().abs().flatten().sort().values
    n = a.numel()
    k = torch.arange(1, n + 1, dtype=torch.float64)
    return (1 - 2 * ((a / a.sum()) * (n - k + 0.5) / n).sum()).item()


def hoyer(t):
    """Hoyer's sparsity of t: (sqrt(N) - |t|_1 / |t|_2) / (sqrt(N) - 1), 0 for equal sizes, 1 for
    one non-zero entry."""
    a = t.double().flatten()
    n = a.numel() ** 0.5
    return ((n - a.abs().sum() / a.norm()) / (n - 1)).item()


def cosine(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


### end Metrics


### begin Capture
def run_flags(run_dir):
    """The flags of the run that wrote `run_dir`, from its run file."""
    path = run_dir / "run.yaml"
    if not path.is_file():
        raise ValueError(
            f"{run_dir} has no run.yaml: capture reads the run's dataset, tokenizer and seq_len "
            f"from the run file the trainer writes into --save_dir"
        )
    return yaml.safe_load(path.read_text())


def probe_batch(flags, rows, vocab_size):
    """The first `rows` rows of the run's validation data: (input ids, targets), (rows, T). A
    streamed run's are read from the start of its stream."""
    args = SimpleNamespace(**{"streaming": False, **flags})
    _, _, validation = load_data(args, vocab_size)
    tokens = validation[list(range(rows))]["tokens"]  # (rows, T + 1)
    # A stream's length is known once it has ended; its rows then count on into the next pass.
    length = validation.length if getattr(validation, "streamed", False) else len(validation)
    if length is not None and length < rows:
        raise ValueError(f"--probe_rows {rows}: the validation data has {length} rows")
    return tokens[:, :-1], tokens[:, 1:]


def whole_model(checkpoint):
    """The checkpoint as one transformers model in fp32 (Llama, or Mixtral for experts)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        export(checkpoint, folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def capture_one(model, inputs, targets):
    """{name: tensor} of one checkpoint: activations, the probe loss and every gradient."""
    found, hooks = {}, []

    def keep(name):
        def hook(module, args, output):
            found[name] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    layers = model.model.layers
    hooks.append(model.model.embed_tokens.register_forward_hook(keep("activations.embed")))
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None) or layer.block_sparse_moe
        hooks += [
            layer.register_forward_hook(keep(f"activations.layers.{i}")),
            layer.self_attn.register_forward_hook(keep(f"activations.layers.{i}.self_attn")),
            mlp.register_forward_hook(keep(f"activations.layers.{i}.mlp")),
        ]
    logits = model(input_ids=inputs).logits  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    for hook in hooks:
        hook.remove()
    tensors = dict(found)
    for name, param in model.named_parameters():
        tensors[f"gradients.{name}"] = param.grad
        tensors[f"weights_gini.{name}"] = torch.tensor(gini(param.detach()))
        tensors[f"weights_hoyer.{name}"] = torch.tensor(hoyer(param.detach()))
    tensors.update({"loss": loss.detach(), "probe.input_ids": inputs})
    return {name: t.contiguous() for name, t in tensors.items()}


def checkpoints(run_dir):
    """The run's checkpoint folders, by step."""
    found = sorted(run_dir.glob("step_[0-9]*"))
    return [path for path in found if path.is_dir()]


def capture(run_dir, probe_rows, step=None):
    """Each checkpoint of the run not captured yet, or only the one of `step`."""
    run_dir = Path(run_dir)
    folders = checkpoints(run_dir)
    if not folders:
        raise ValueError(f"{run_dir} has no checkpoint (step_*/): train with --save_dir {run_dir}")
    if step is not None:
        folders = [folder for folder in folders if folder.name == f"step_{step:06d}"]
        if not folders:
            raise ValueError(f"{run_dir} has no checkpoint of step {step}")
    flags, out = run_flags(run_dir), run_dir / "dynamics"
    out.mkdir(exist_ok=True)
    probe = None
    for folder in folders:
        target = out / f"{folder.name}.safetensors"
        if target.exists():
            print(f"{target}: captured already")
            continue
        model = whole_model(folder)
        if probe is None:
            probe = probe_batch(flags, probe_rows, model.config.vocab_size)
        tensors = capture_one(model, *probe)
        partial = target.with_name(f".{target.name}.tmp")  # a capture cut short is not one
        save_file(tensors, partial, metadata={"step": str(int(folder.name.split("_")[1]))})
        os.replace(partial, target)
        print(f"{target}: probe loss {tensors['loss'].item():.4f}")


### end Capture


### begin Report
def read(path):
    with safe_open(path, framework="pt") as f:
        return int(f.metadata()["step"]), {name: f.get_tensor(name) for name in f.keys()}


def captured(run_dir):
    """[(step, tensors)] of a run's captured checkpoints, by step."""
    files = sorted((Path(run_dir) / "dynamics").glob("step_*.safetensors"))
    if not files:
        raise ValueError(f"{run_dir}/dynamics holds nothing: run `capture {run_dir}` first")
    return [read(path) for path in files]


def layer_names(tensors):
    layers = [n for n in tensors if n.startswith("activations.layers.") and n.count(".") == 2]
    return ["activations.embed", *sorted(layers, key=lambda n: int(n.split(".")[2]))]


def gradients(tensors):
    return torch.cat([t.flatten() for n, t in tensors.items() if n.startswith("gradients.")])


def compare(a, b):
    """Per layer, CKA and PWCCA between two captures of the same probe."""
    if not torch.equal(a["probe.input_ids"], b["probe.input_ids"]):
        raise ValueError("the two captures ran different probe batches: compare runs of one data")
    return {
        name.removeprefix("activations."): (linear_cka(a[name], b[name]), pwcca(a[name], b[name]))
        for name in layer_names(a)
    }


def summary(step, tensors):
    grads = gradients(tensors)
    weights = [v.item() for n, v in tensors.items() if n.startswith("weights_gini.")]
    last = layer_names(tensors)[-1]
    return {
        "step": step,
        "loss": tensors["loss"].item(),
        "grad_norm": grads.norm().item(),
        "grad_gini": gini(grads),
        "grad_hoyer": hoyer(grads),
        "weight_gini_mean": sum(weights) / len(weights),
        "activation_gini_last": gini(tensors[last]),
        "activation_hoyer_last": hoyer(tensors[last]),
    }


def report(run_dir, against=None):
    """{"steps": per-step facts, "layers": per-pair CKA/PWCCA per layer}."""
    mine = captured(run_dir)
    steps = [summary(step, tensors) for step, tensors in mine]
    for before, now in zip(mine, mine[1:], strict=False):
        steps[mine.index(now)]["grad_cosine_to_previous"] = cosine(
            gradients(before[1]), gradients(now[1])
        )
    pairs = []
    if against is None:  # across the run: each checkpoint against the one before
        for (s0, t0), (s1, t1) in zip(mine, mine[1:], strict=False):
            pairs.append({"steps": [s0, s1], "layers": compare(t0, t1)})
    else:  # between runs, at the steps both captured
        theirs = dict(captured(against))
        for step, tensors in mine:
            if step in theirs:
                pair = {"steps": [step, step], "layers": compare(tensors, theirs[step])}
                pair["max_activation_diff"] = max(
                    (tensors[n] - theirs[step][n]).abs().max().item() for n in layer_names(tensors)
                )
                pair["grad_cosine"] = cosine(gradients(tensors), gradients(theirs[step]))
                pairs.append(pair)
        if not pairs:
            raise ValueError(f"{run_dir} and {against} captured no step in common")
    return {"steps": steps, "pairs": pairs}


def print_report(facts, against):
    print("step    loss  grad_norm  grad_gini  weight_gini  act_gini(last)  grad_cos(prev)")
    for s in facts["steps"]:
        cos = s.get("grad_cosine_to_previous")
        print(
            f"{s['step']:>4} {s['loss']:>7.4f} {s['grad_norm']:>10.4f} {s['grad_gini']:>10.4f} "
            f"{s['weight_gini_mean']:>12.4f} {s['activation_gini_last']:>15.4f} "
            f"{'' if cos is None else f'{cos:.4f}':>15}"
        )
    what = f"against {against}" if against else "each checkpoint against the one before"
    print(f"\nlinear CKA / PWCCA of the residual stream, {what}:")
    for pair in facts["pairs"]:
        cells = "  ".join(f"{n} {c:.6f}/{p:.6f}" for n, (c, p) in pair["layers"].items())
        print(f"steps {pair['steps'][0]}-{pair['steps'][1]}: {cells}")
        if "grad_cosine" in pair:
            print(
                f"  max |activation difference| {pair['max_activation_diff']:.3g}, cosine of "
                f"the gradients {pair['grad_cosine']:.6f}"
            )


def plot(facts, path, against):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError('-o needs matplotlib: pip install -e ".[plot]"') from None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    layers = list(facts["pairs"][0]["layers"]) if facts["pairs"] else []
    x = [pair["steps"][1] for pair in facts["pairs"]]
    for layer in layers:
        axes[0].plot(x, [pair["layers"][layer][0] for pair in facts["pairs"]], "o-", label=layer)
    axes[0].set(title=f"linear CKA, {'against ' + str(against) if against else 'to previous'}")
    axes[0].set(xlabel="step")
    if layers:
        axes[0].legend(fontsize=7)
    steps = [s["step"] for s in facts["steps"]]
    axes[1].plot(steps, [s["grad_norm"] for s in facts["steps"]], "o-")
    axes[1].set(title="probe gradient norm", xlabel="step")
    for key in ["grad_gini", "weight_gini_mean", "activation_gini_last"]:
        axes[2].plot(steps, [s[key] for s in facts["steps"]], "o-", label=key)
    axes[2].set(title="Gini sparsity", xlabel="step")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


### end Report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["capture", "report"])
    parser.add_argument("run_dir", help="the run's --save_dir")
    parser.add_argument("--probe_rows", type=int, help="capture: validation rows in the probe (4)")
    parser.add_argument("--step", type=int, help="capture: only this step's checkpoint")
    parser.add_argument("--against", help="report: another captured run, compared step by step")
    parser.add_argument("-o", "--plot", help="report: draw it into this image file")
    parser.add_argument("--json", help="report: write its figures into this file")
    args = parser.parse_args(argv)
    wrong = ["probe_rows", "step"] if args.command == "report" else ["against", "plot", "json"]
    for name in wrong:
        if getattr(args, name) is not None:
            parser.error(f"--{name} is not for {args.command}")
    try:
        if args.command == "capture":
            rows = 4 if args.probe_rows is None else args.probe_rows
            if rows < 1:
                raise ValueError(f"--probe_rows must be at least 1, got {rows}")
            capture(args.run_dir, rows, args.step)
            return
        facts = report(args.run_dir, args.against)
        print_report(facts, args.against)
        if args.json:
            Path(args.json).write_text(json.dumps(facts, indent=1))
        if args.plot:
            plot(facts, args.plot, args.against)
            print(f"wrote {args.plot}")
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
