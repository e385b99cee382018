"""Every numeric flag of every step 3-15 declares its domain, and a value outside it is refused
before anything runs: one line naming the flag and the value, exit status 2, no traceback.

The cases come from each step's own parser: every flag whose type reads a number (the shared
ones of flags.py and the step's own) gets NaN, +inf, -inf, -1, 0, a value past 64 bits (floats:
1e300) and a word. Which of them are outside the domain is said here, not read from the domains,
so that a bound dropped from a domain fails a case instead of dropping it: no flag takes a value
that is not finite, a negative one or a word; 0 only those of ZERO_IS_VALID; a float of 1e300
all but those of TOPPED. The values inside must pass. The cases run in this process
(`utils.run_main` around the step's `parse_args`, the first thing its `main` does); a few run
end to end, under the launcher with two ranks.
"""

import json
import re
import sys

import pytest
from conftest import ROOT, exit_here, import_step, run_step
from steps import step_folders, step_number

STEPS = [folder.name for folder in step_folders(ROOT) if step_number(folder) >= 3]
# The numeric flags for which 0 means something: none, never, off, or the seed 0.
ZERO_IS_VALID = {
    "warmup_steps", "eval_every", "early_stopping_patience", "sample_tokens", "weight_decay",
    "seed", "aux_loss_coef", "z_loss_coef", "expert_bias_rate",
}  # fmt: skip
# The float flags with a top: a fraction, and a timeout that the libraries' timers must hold.
TOPPED = {"decay_fraction", "dist_timeout_s"}
HUGE = {"int": str(2**63), "float": "1e300"}


class Built(Exception):
    """Raised with the parser that parse_args built, in place of parsing."""


def step_parser(step, monkeypatch):
    """The step's train module, and the parser its parse_args builds: the shared flags and the
    step's own."""
    train = import_step(step, "train")

    def built(parser, *rest):
        raise Built(parser)

    with monkeypatch.context() as patch:
        patch.setattr(train, "parse", built)
        with pytest.raises(Built) as parser:
            train.parse_args([])
    return train, parser.value.args[0]


def numeric_flags(parser):
    """The flags whose type reads a number: argparse's int or float, or a Domain of either."""
    return [
        action
        for action in parser._actions
        if action.option_strings and getattr(action.type, "__name__", "") in ("int", "float")
    ]


def cases(action):
    """(word, refused): what the flag gets, and whether it must be refused."""
    kind, name = action.type.__name__, action.dest
    return [
        ("nan", True),
        ("inf", True),
        ("-inf", True),
        ("-1", True),
        ("0", name not in ZERO_IS_VALID),
        (HUGE[kind], kind == "int" or name in TOPPED),
        ("abc", True),
    ]


def spellings(word, kind):
    """How a refusal may write the word: as given, or as the flag's type prints it."""
    try:
        return {word, str({"int": int, "float": float}[kind](word))}
    except ValueError:
        return {word}


def run_parse(train, argv, capsys, monkeypatch):
    """`python train.py argv` as far as its flags' checks, in this process: the exit status
    (None where the checks pass) and what it printed."""
    utils = sys.modules["utils"]  # the step's own, imported by train
    monkeypatch.setattr(utils.os, "_exit", exit_here)
    code = None
    try:
        utils.run_main(lambda: train.parse_args(argv))
    except SystemExit as exit:
        code = exit.code
    printed = capsys.readouterr()
    return code, printed.out + printed.err


def is_one_line_naming(output, flag, words):
    lines = output.splitlines()
    return (
        len(lines) == 1
        and lines[0].startswith("error: ")
        and re.search(re.escape(flag) + r"\b", lines[0])
        and any(word in lines[0] for word in words)
    )


@pytest.mark.parametrize("step", STEPS)
def test_every_numeric_flag_refuses_what_is_outside_its_domain(step, capsys, monkeypatch):
    train, parser = step_parser(step, monkeypatch)
    flags = numeric_flags(parser)
    assert len(flags) > 30, [a.dest for a in flags]  # the shared ones at least
    # A domain, or the values allowed (--zero_stage's 1, 2, 3).
    Domain = sys.modules["flags"].Domain
    bare = [a.option_strings[0] for a in flags if not (isinstance(a.type, Domain) or a.choices)]
    assert not bare, f"declared without a domain (type=int or float): {bare}"
    wrong = []
    for action in flags:
        flag, kind = action.option_strings[0], action.type.__name__
        for word, refuse in cases(action):
            # With "=": argparse would read "-inf" alone as a flag.
            code, output = run_parse(train, [f"{flag}={word}"], capsys, monkeypatch)
            if refuse and not (
                code == 2 and is_one_line_naming(output, flag, spellings(word, kind))
            ):
                wrong.append(f"{flag}={word}: exit {code}, {output.strip()[-300:]!r}")
            if not refuse and code is not None:
                wrong.append(f"{flag}={word} is in the domain, but: {output.strip()[-300:]!r}")
    assert not wrong, "\n".join(wrong)


def test_a_run_file_is_held_to_the_same_domains(tmp_path, capsys, monkeypatch):
    """The same words as values of a run file (--config), in the step with the most flags: one
    line naming the file, the key and the value."""
    train, parser = step_parser(STEPS[-1], monkeypatch)
    run_file, wrong = tmp_path / "run.json", []
    for action in numeric_flags(parser):
        for word, refuse in cases(action):
            run_file.write_text(json.dumps({action.dest: word}))
            code, output = run_parse(train, ["--config", str(run_file)], capsys, monkeypatch)
            where = f"--config {run_file}: {action.dest}"
            if refuse and not (code == 2 and is_one_line_naming(output, where, {repr(word)})):
                wrong.append(f"{action.dest}: {word}: exit {code}, {output.strip()[-300:]!r}")
    assert not wrong, "\n".join(wrong)


# Under the launcher, two ranks: a value that reached a library (numpy's seed: a traceback), one
# that trained (a NaN bias rate moved every expert's bias to NaN), and a technique flag's.
END_TO_END = [
    ("step3_dataloader", ["--seed=-1"], "--seed must be 0 or more and at most 4294967295, got -1"),
    (
        "step15_expert_parallel",
        ["--model_name", "tiny-moe", "--expert_bias_rate=nan"],
        "--expert_bias_rate must be finite, got nan",
    ),
    ("step11_context_parallel", ["--cp_size=0"], "--cp_size must be at least 1, got 0"),
]


@pytest.mark.parametrize(("step", "args", "message"), END_TO_END)
def test_refused_under_the_launcher(step, args, message):
    result = run_step(step, args, nproc=2, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-2000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {message} (--help lists the flags)"], output[-2000:]
    assert "Traceback" not in output
