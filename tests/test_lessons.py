"""What the lessons say is true: every flag a step README names is one of its step's (or of the
tool or launcher it names), every file it names exists, every figure it shows is made by a
command shown, and the numbers it quotes as a command's output are what the command or the code
gives (the grid's refusal, the parameters per tensor-parallel rank, ZeRO's bytes, the pipeline
schedules and bubble, the ring's blocks). The docs/ lessons are held to the same paths and
flags."""

import functools
import json
import os
import re
import shlex
import subprocess

import pytest
import torch
from conftest import LAUNCH, ROOT, import_step

STEP_READMES = sorted(ROOT.glob("step*/README.md"))
DOCS = sorted((ROOT / "docs").glob("*.md"))
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*")
# A flag a README names as a later step's ("from step 8's `--pp_timeline`"): the step that has it.
LATER = {
    "step2_process_group_manager": {"--cp_size": "step11_context_parallel"},
}


def run(argv, cwd=ROOT, timeout=120):
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )


@functools.cache
def help_flags(script):
    """The options `python SCRIPT --help` lists (forked from the tests' launch server): each
    option line's names (`  --nproc-per-node N, --nproc_per_node N`), not its description, which
    may name another script's flags."""
    result = run([*LAUNCH, "--python", str(script), "--help"])
    assert result.returncode == 0, f"{script} --help: exit {result.returncode}\n{result.stderr}"
    lines = re.findall(r"^  (-.*?)(?: {2,}|$)", result.stdout, re.MULTILINE)
    flags = frozenset(flag for line in lines for flag in FLAG.findall(line))
    assert "--help" in flags, result.stdout
    return flags


def torchrun_flags():
    import torch.distributed.run

    return help_flags(torch.distributed.run.__file__)


def prose(text):
    """The text outside fenced code blocks."""
    return "".join(text.split("```")[::2])


def code_blocks(text):
    return text.split("```")[1::2]


def tools_named(text):
    return sorted({ROOT / "tools" / f"{name}.py" for name in re.findall(r"tools/(\w+)\.py", text)})


@pytest.mark.parametrize("readme", STEP_READMES, ids=lambda p: p.parent.name)
def test_every_flag_a_step_readme_names_exists(readme):
    text, step = readme.read_text(), readme.parent.name
    known = set(help_flags(ROOT / step / "train.py"))
    for tool in tools_named(text):
        known |= help_flags(tool)
    if "torchrun" in text:
        known |= torchrun_flags()
    later = LATER.get(step, {})
    for flag, where in later.items():
        assert flag not in known, f"{step} has {flag} now: drop it from LATER"
        assert flag in help_flags(ROOT / where / "train.py"), f"{where} has no {flag}"
    missing = sorted(set(FLAG.findall(text)) - known - set(later))
    assert not missing, f"{readme.relative_to(ROOT)} names flags that {step} lacks: {missing}"


def test_every_flag_a_doc_names_exists():
    known = set(torchrun_flags())
    for readme in STEP_READMES:
        known |= help_flags(readme.parent / "train.py")
    for doc in DOCS:
        text = doc.read_text()
        for tool in tools_named(text):
            known |= help_flags(tool)
        missing = sorted(set(FLAG.findall(text)) - known)
        assert not missing, f"{doc.relative_to(ROOT)} names flags no step or tool has: {missing}"


PATH = re.compile(r"^(?:\.\./)?[\w.-]+(?:/[\w.-]+)*\.(?:py|md|png|sh|patch)$")


def named_paths(readme):
    """The files a lesson names: its links and images, and the file names in its inline code."""
    text = prose(readme.read_text())
    links = [t for t in re.findall(r"\]\(([^)\s#]+)", text) if "://" not in t]
    spans = [t for t in re.findall(r"`([^`\n]+)`", text) if PATH.match(t)]
    return links, spans


def resolve(readme, name):
    """A link or `../x` is relative to the lesson; `a/b.py` to the repository; `b.py` is the
    step's own file (for docs/, a file of some step)."""
    if name.startswith("../") or "/" not in name and readme.parent.name.startswith("step"):
        return [readme.parent / name]
    if "/" in name:
        return [ROOT / name]
    return [readme.parent / name, *(p.parent / name for p in STEP_READMES)]


@pytest.mark.parametrize("readme", STEP_READMES + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_lesson_names_exists(readme):
    links, spans = named_paths(readme)
    missing = [link for link in links if not (readme.parent / link).exists()]
    missing += [name for name in spans if not any(p.exists() for p in resolve(readme, name))]
    assert not missing, f"{readme.relative_to(ROOT)} names files that do not exist: {missing}"


def test_every_figure_is_made_by_a_command_shown():
    """An image in a lesson is drawn by a command of some README (its -o names the file)."""
    commands = "\n".join(
        block
        for readme in [*STEP_READMES, ROOT / "tools" / "README.md", *DOCS]
        for block in code_blocks(readme.read_text())
    )
    made = {name.rsplit("/", 1)[-1] for name in re.findall(r"-o\s+(\S+\.png)", commands)}
    for readme in STEP_READMES + DOCS:
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme.read_text()):
            assert (readme.parent / image).is_file(), f"{readme}: {image}"
            assert image.rsplit("/", 1)[-1] in made, f"{readme}: no command shown draws {image}"


def test_step2_quotes_what_a_grid_that_does_not_fit_prints():
    text = (ROOT / "step2_process_group_manager" / "README.md").read_text()
    command = re.search(r"`(torchrun [^`]*--tp_size 3)`", text)[1]
    quoted = next(line for line in text.splitlines() if line.startswith("error: tp_size"))
    tokens = shlex.split(command)
    nproc = tokens[tokens.index("--nproc_per_node") + 1]
    result = run([*LAUNCH, f"--nproc_per_node={nproc}", *tokens[3:]])
    assert result.returncode == 2, result.stderr
    assert quoted in result.stderr.splitlines(), result.stderr
    assert "Traceback" not in result.stderr


def tiny_model():
    from transformers import LlamaConfig

    config = json.loads((ROOT / "assets" / "configs" / "tiny" / "config.json").read_text())
    model_lib = import_step("step1_model", "model")
    with torch.device("meta"):
        return model_lib.LlamaForCausalLM(LlamaConfig(**config))


def test_step4_and_step10_quote_the_tiny_model_sizes():
    """Parameters per tp rank (every matrix split, the RMSNorm weights whole) and ZeRO-1's bytes
    of AdamW moments per dp rank (8 per parameter over dp; weights + gradients + moments
    8 + 8 / dp)."""
    named = dict(tiny_model().named_parameters())
    total = sum(p.numel() for p in named.values())
    whole = sum(p.numel() for name, p in named.items() if name.endswith("norm.weight"))
    step4 = (ROOT / "step4_tensor_parallel" / "README.md").read_text()
    assert f"{total:,}" in step4 and f"{whole:,}" in step4
    assert f"{(total - whole) // 2 + whole:,} parameters per rank" in step4
    step10 = (ROOT / "step10_zero1" / "README.md").read_text()
    assert f"{total:,} parameters" in step10
    for dp in (1, 2, 4):
        assert f"| {dp} | {8 * total // dp:,} bytes ({8 * total / dp / 2**20:.1f} MiB)" in step10
        assert f"| {(8 + 8 / dp) * total / 2**20:.1f} MiB |" in step10
    assert f"optimizer state: {8 * total // 4:,} bytes" in step10


def test_step7_draws_the_afab_slots_of_its_bubble_formula():
    """The slot picture: micro-batch k forward on stage s at slot s + k - 1, backward at
    m + p - 2 + k + (p - 1 - s); idle p - 1 slots per phase, (p - 1) / (m + p - 1) of the step."""
    text = (ROOT / "step7_pipeline_parallel_afab" / "README.md").read_text()
    p, m = 3, 4
    rows = []
    for s in range(p):
        slots = ["."] * 2 * (m + p - 1)
        for k in range(1, m + 1):
            slots[s + k - 1] = f"F{k}"
            slots[m + p - 2 + k + (p - 1 - s)] = f"B{k}"
        rows.append(f"stage {s}   " + " ".join(f"{x:<2}" for x in slots).rstrip())
    assert "\n".join(rows) in text
    assert f"{p - 1} / {m + p - 1} = {(p - 1) / (m + p - 1):.2f}" in text
    assert f"3 / 11 = {3 / 11:.2f} at p 4 and m 8" in text


def test_step8_quotes_the_schedules_the_run_prints():
    """The 1F1B listing of step 8's lesson is what --pp_timeline prints at pp 4, m 8: stage r
    starts with pp_size - r forwards (warm-up pp_size - r - 1, then the steady state's first)."""
    text = (ROOT / "step8_pipeline_parallel_1f1b" / "README.md").read_text()
    shape = ["--num_hidden_layers", "4", "--hidden_size", "64", "--intermediate_size", "128"]
    shape += ["--num_attention_heads", "4", "--num_key_value_heads", "2", "--seq_len", "16"]
    args = ["--pp_size", "4", "--pp_engine", "1f1b", "--micro_batch_size", "1"]
    args += ["--gradient_accumulation_steps", "8", "--pp_timeline", "--max_steps", "1"]
    args += ["--eval_steps", "1", "--sample_tokens", "1", "--num_proc", "1", *shape]
    script = ROOT / "step8_pipeline_parallel_1f1b" / "train.py"
    result = run([*LAUNCH, "--nproc_per_node=4", str(script), *args], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = dict(re.findall(r"pp stage (\d) 1f1b: ([FB0-9 ]+?) \|", result.stdout))
    assert sorted(printed) == ["0", "1", "2", "3"], result.stdout
    listing = text.split("1F1B   stage 0", 1)[1].split("```", 1)[0]
    for r in range(4):
        order = printed[str(r)]
        assert re.search(rf"stage {r}\s+{order}\s+held {4 - r}\n", "stage 0" + listing), order
        forwards = order.split().index("B1")
        assert forwards == 4 - r and f"held at most {4 - r}" in result.stdout


def test_step11_quotes_the_blocks_each_rank_computes():
    text = " ".join((ROOT / "step11_context_parallel" / "README.md").read_text().split())
    cp_lib = import_step("step11_context_parallel", "context_parallel")

    def counts(chunk_ids):
        """Blocks of rank r at ring step k, where it holds the keys of rank (r - k) mod 4."""
        cp_lib.chunk_ids = chunk_ids
        return [[len(list(cp_lib.blocks(r, (r - k) % 4, 4))) for k in range(4)] for r in range(4)]

    balanced = counts(cp_lib.chunk_ids)
    naive = counts(lambda rank, size: (2 * rank, 2 * rank + 1))
    totals = f"Balanced, `{[sum(row) for row in balanced]}`; naive, `{[sum(row) for row in naive]}`"
    assert totals in text
    assert all(row == balanced[0] for row in balanced) and f"`{balanced[0]}` each" in text
    per_rank = [f"`{row}`" for row in naive]
    assert f"compute {per_rank[0]} (rank 0), {per_rank[1]}, {per_rank[2]} and {per_rank[3]}" in text
    per_step = [f"`{[naive[r][k] for r in range(4)]}`" for k in range(4)]
    assert f"compute {per_step[0]}, then {per_step[1]}, {per_step[2]} and {per_step[3]}" in text


def test_step11_shows_the_block_grid_its_command_draws():
    """The grid of blocks in step 11's lesson is tools/cp_blocks.py's output, to the character,
    and every block below the diagonal is computed once, by the rank that holds its queries."""
    result = run([*LAUNCH, "--python", str(ROOT / "tools" / "cp_blocks.py"), "--cp_size", "4"])
    assert result.returncode == 0, result.stderr
    lesson = (ROOT / "step11_context_parallel" / "README.md").read_text()
    assert f"```text\n{result.stdout}```" in lesson
    cp_lib = import_step("step11_context_parallel", "context_parallel")
    rows = [line.split()[1:] for line in result.stdout.splitlines()[3:11]]
    for q, row in enumerate(rows):
        cells = " ".join(row).replace("\\", " ").split()
        owner = next(r for r in range(4) if q in cp_lib.chunk_ids(r, 4))
        assert cells[: 2 * (q + 1) : 2] == [str(owner)] * (q + 1), (q, row)
        assert row[-(7 - q) :] == ["."] * (7 - q) if q < 7 else True, (q, row)


def test_the_tensor_parallel_picture_is_the_same_in_step4_and_docs():
    picture = code_blocks((ROOT / "docs" / "tp_block.md").read_text())[0]
    assert picture in (ROOT / "step4_tensor_parallel" / "README.md").read_text()
