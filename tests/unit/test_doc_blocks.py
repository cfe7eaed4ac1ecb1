"""Every code block of README.md and docs/*.md that a user would paste works as written.

```sh blocks: each `threefold ...` command is parsed by the real parser and its options and
`--set` keys resolved by `load_config` (a wrong option, key or value fails here); a script or
make target they name exists. ```python blocks compile and every threefold name they import
exists (the runnable ones also run: tests/distributed/test_doc_examples.py). Placeholders are
parsed but not run: `...` is dropped, `$VAR` takes a sample value, a config file or `hf:` model
directory that is not in the repository stands for the user's own (the defaults; a small Llama
config.json). A train command is also checked against the world it names, as the launcher checks it.
"""

import ast
import contextlib
import importlib.util
import io
import json
import re

import pytest

from tests.doc_blocks import CODE, COMMAND_LINE, NOT_RUN, ROOT, blocks, commands
from threefold.cli import build_parser
from threefold.config import load_config
from threefold.errors import ConfigError, UserError
from threefold.train.command import overrides_from

BLOCKS = blocks()
SAMPLE_ENV = {"STDLIB": "/usr/lib/python3", "USER": "me", "NODE_RANK": "0"}  # what a reader sets before pasting
READERS_FILES = ("data.source", "checkpoint.init_from")  # paths to the reader's own files: checked when they run
OTHER_PROGRAMS = {"pip", ".", "source", "squeue", "tail", "cd", "export"}  # commands of other programs: not checked


def test_the_documents_have_code_blocks():
    assert len([b for b in BLOCKS if b.lang == "sh"]) >= 10 and len([b for b in BLOCKS if b.lang == "python"]) >= 3


def test_every_block_is_code_or_marked_as_not_run():
    for block in BLOCKS:
        assert block.lang in ("", *CODE, *NOT_RUN), \
            f"{block.where}: ```{block.lang}: tag it python or sh (checked), or text / json / toml (not run)"
        if block.lang == "":  # output: a command in it would be pasted and never checked
            pasted = [line for line in block.text.splitlines() if COMMAND_LINE.match(line)]
            assert not pasted, (f"{block.where}: {pasted[0]!r} is a command in a block without a tag: tag the "
                                "block sh (checked) or text (not run), or write a transcript's command as '$ ...'")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_python_blocks_compile_and_name_what_threefold_has(block):
    tree = ast.parse(block.text, filename=block.where)  # a SyntaxError names the block's line
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "threefold":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{block.where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "threefold":
                    modules[alias.asname or alias.name.split(".")[0]] = importlib.import_module(alias.name.split(".")[0])
    for node in ast.walk(tree):  # threefold.prepare(...): the attribute exists
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            assert hasattr(modules[node.value.id], node.attr), f"{block.where}: threefold has no {node.attr}"


def _expand(word: str, where: str) -> str:
    def value(found: re.Match) -> str:
        name = found.group(1) or found.group(2)
        assert name in SAMPLE_ENV, f"{where}: ${name}: add a sample value for it to SAMPLE_ENV"
        return SAMPLE_ENV[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, word)


def _in_repository(path: str) -> bool:
    return (ROOT / path).exists()


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> str:
    """A Hugging Face Llama directory (its config.json: all that resolving a config reads) standing for
    the reader's own (`--model hf:path/to/llama`)."""
    path = tmp_path_factory.mktemp("llama")
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "hidden_act": "silu"}))
    return str(path)


def check_threefold(argv: list[str], where: str, standin: str, world_known: bool = True) -> None:
    """Parse as `threefold` would; resolve the config of train and plan as they do. A train command
    whose config is all on the line, on a world it names itself (--nproc, --nnodes; not torchrun's),
    is also checked against that world as the launcher checks it before starting a process."""
    argv = [a for a in argv if a != "..."]  # the rest of a command the reader completes
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: threefold {' '.join(argv)}: {err.getvalue().strip()}")
    if args.command == "train":
        config = str(ROOT / args.config) if args.config and _in_repository(args.config) else None
        overrides = overrides_from(args)
    elif args.command == "plan":
        config, overrides = None, [f"model.preset={args.model}", *args.overrides]
    else:
        return
    overrides = [f"model.preset=hf:{standin}" if o.startswith("model.preset=hf:") and not _in_repository(o[16:])
                 else o for o in overrides]
    try:
        cfg = load_config(config, overrides)
        if args.command == "train" and world_known and (config is not None or not args.config):
            cfg.validate((args.nproc or 1) * int(str(args.nnodes or 1).split(":")[-1]))
    except ConfigError as e:
        if e.field not in READERS_FILES:
            pytest.fail(f"{where}: threefold {' '.join(argv)}: {e}")
    except UserError as e:
        pytest.fail(f"{where}: threefold {' '.join(argv)}: {e}")


def check_command(words: list[str], where: str, standin: str) -> None:
    while words and re.match(r"^\w+=", words[0]):  # VAR=value before the command
        words = words[1:]
    words = [_expand(w, where) for w in words]
    head, rest = words[0], words[1:]
    if head == "threefold":
        check_threefold(rest, where, standin)
    elif head == "torchrun":
        assert "-m" in rest and rest[rest.index("-m") + 1] == "threefold", f"{where}: torchrun of what?"
        check_threefold(rest[rest.index("-m") + 2:], where, standin, world_known=False)  # torchrun's options say the world
    elif head in ("python", "python3") and rest[:2] == ["-m", "threefold"]:
        check_threefold(rest[2:], where, standin)
    elif head in ("python", "python3") and rest[0] == "-m":
        assert rest[1] in ("venv", "pip"), f"{where}: python -m {rest[1]}: not a module this test knows"
    elif head in ("python", "python3", "bash", "sbatch", "srun"):
        script = next(w for w in rest if not w.startswith("-") and re.search(r"\.(py|sh|sbatch)$", w))
        assert _in_repository(script), f"{where}: {script} does not exist"
        text, extra = (ROOT / script).read_text(), rest[rest.index(script) + 1:]
        if re.search(r'threefold train .*"\$@"', text):  # a job script whose arguments go to `threefold train`
            check_threefold(["train", *extra], where, standin)
        else:
            for option in (w.split("=")[0] for w in extra if w.startswith("--")):
                # argparse's "--name", or a shell script's case pattern `--name)` / `--name|`
                assert re.search(rf'"{option}"|^\s*{option}[)|]', text, re.M), f"{where}: {script} has no option {option}"
    elif head == "make":
        makefile = (ROOT / "Makefile").read_text()
        for target in rest:
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{where}: make has no target {target}"
    else:
        assert head in OTHER_PROGRAMS, f"{where}: {head}: a command this test does not know (add it to " \
                                       "OTHER_PROGRAMS if it is another program's)"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "sh"], ids=lambda b: b.where)
def test_shell_blocks_parse_and_resolve(block, standin):
    for words in commands(block.text):
        check_command(words, block.where, standin)
