"""Which committed results folder answers which claim and which table: results/claims.yaml. The
report (`python -m repro.report`: every section takes its folders from it and reads no other),
the claims table (repro.reproduction.report.claims) and the check of README's "What we found"
(tests/test_docs.py) read it; nothing else chooses runs, and a folder it does not name is not shown.

    claims:   {claim: folder}      the run each claim of the claims table is judged from (CLAIMS)
    report:   {section: ...}       the folders each section of REPORT.md shows, in this order (REPORT;
                                   a section module added to the report package takes a list of folders)
    readme:   [file, ...]          the files README's "What we found" table quotes
    runs:     {folder: command}    every folder cited above, with where its command is: command.txt,
                                   README.md (the folder's, or a line of a parent's naming it), <run>.json
                                   (the JSON beside each run file cited), or the command itself
    archived: {folder: reason}     committed folders nothing cites, each with why

Paths are relative to the results folder. A mistake (an unknown key, a folder that is not there,
a folder cited without its command or named in runs but cited nowhere) is one ManifestError
naming the key and the folder."""
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from repro.common.errors import ConfigError
from repro.common.results import repo_relative

NAME = "claims.yaml"


class ManifestError(ConfigError):
    """A manifest that does not say what it must: one line naming the file, the key and the folder."""


# the claims of the claims table that are judged from a run, each with what it reads there
CLAIMS = {
    "figure1": "Figure 1: time slopes and the largest N (summary.json; the slopes' intervals from benchmark.csv)",
    "copy": "Figure 2: linear reaches softmax's copy loss, LSH-4 ends above both (copy_rows.jsonl)",
    "copy_sweep": "Figure 2 at N = 128: linear against width, per-head state and budget (a folder of cells, each "
                  "a folder with copy_rows.jsonl)",
    "copy_authors": "Figure 2 at N = 128: the authors' copy script beside ours at the judged run's settings "
                    "(fidelity_runs.csv)",
    "mnist": "Tables 1 and 2: the MNIST bits/dim order, and linear below softmax at equal time (image_rows.jsonl)",
    "asr": "Table 3: linear's speed-up per epoch (asr_table.csv, asr_rows.jsonl)",
    "batch": "linear's lead over the key/value cache against the batch (throughput.csv)",
    "gpu_generation": "a GPU's generation at batch 1 and at its largest batch (throughput.csv)",
    "gpu_mnist": "a GPU's training step of the paper's MNIST model (bpd_final.csv)",
}

# what each section of the report takes: folders, files, or columns (one run at one batch)
FOLDERS, FILES, COLUMNS = "a list of folders", "a list of files", "a list of columns"
COLUMN_KEYS = ("folder", "batch", "quiet")  # {folder, batch[, quiet: true]}: the header says "quiet run"
REPORT = {
    "figure1": FOLDERS, "figure2": FOLDERS, "fidelity": FOLDERS,
    "tables_1_2": {"bits_per_dim": FOLDERS, "images_per_s": COLUMNS, "bpd_vs_time": FOLDERS},
    "table_4": COLUMNS, "table_5": COLUMNS, "table_3": FOLDERS,
    "memory": FOLDERS, "kernels": FOLDERS, "cpu_speed": FILES, "gpu_runs": FOLDERS, "others": FOLDERS,
}
NOT_READ = ("others",)  # listed with their commands; no number of theirs is shown
TOP = ("claims", "report", "readme", "runs", "archived")
COMMAND_TXT, README, RUN_JSON = "command.txt", "README.md", "<run>.json"


@dataclass(frozen=True)
class Column:
    """One column of Tables 1/2, 4 or 5: one throughput run (its folder) at one batch."""
    folder: Path
    batch: int
    quiet: bool = False


@dataclass(frozen=True)
class Manifest:
    root: Path          # the results folder the paths are relative to
    claims: dict        # claim -> folder
    report: dict        # section -> its value (the shapes of REPORT)
    readme: tuple       # files
    runs: dict          # folder -> command
    archived: dict      # folder -> reason

    def claim(self, key: str) -> str | None:
        """The folder (relative to the results folder) a claim is judged from, or None."""
        return self.claims.get(key)

    def _value(self, section, part=None):
        value = self.report.get(section)
        return (value or {}).get(part) if part is not None else value

    def paths(self, section: str, part: str | None = None) -> list[Path]:
        """The folders (or files) named for a section or one of its parts, in order; a column's folder once."""
        value = self._value(section, part)
        if isinstance(value, dict):  # every part of the section
            return list(dict.fromkeys(p for k in value for p in self.paths(section, k)))
        items = [value] if isinstance(value, str) else value or []
        return list(dict.fromkeys(self.root / (v["folder"] if isinstance(v, dict) else v) for v in items))

    def columns(self, section: str, part: str | None = None) -> list[Column]:
        return [Column(self.root / c["folder"], int(c["batch"]), bool(c.get("quiet", False)))
                for c in self._value(section, part) or []]

    def read(self) -> list[Path]:
        """Every folder and file whose CSVs the report's sections read (the Other results aside)."""
        return list(dict.fromkeys(p for _, section, part in _parts(self) if section not in NOT_READ
                                  for p in self.paths(section, part)))


def load(root, path=None) -> Manifest:
    """The manifest of the results folder `root` (its claims.yaml unless `path`), checked."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    root = Path(root).resolve()
    path = Path(path) if path is not None else root / NAME
    if not path.is_file():
        raise ManifestError(f"{repo_relative(path)}: no such file: the report and the claims show only the runs it "
                            "names (docs/results.md)")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (YAMLError, OmegaConfBaseException) as err:
        raise ManifestError(f"{repo_relative(path)}: not valid YAML ({' '.join(str(err).split())[:200]})") from None
    return check(root, data if data is not None else {}, repo_relative(path))


def report_shapes() -> dict:
    """REPORT, and a list of folders for any other section a module of the report package declares."""
    from repro.reproduction.report.sections import section_modules

    names = [name for m in section_modules() for _, name, _ in m.SECTIONS if name != "claims"]  # claims: its own key
    return {**dict.fromkeys(names, FOLDERS), **REPORT}


def check(root: Path, data, where: str) -> Manifest:
    """A Manifest from the file's contents, or one ManifestError naming what is wrong."""
    def fail(key, why):
        raise ManifestError(f"{where}: {key}: {why}")

    def mapping(value, key) -> dict:
        if not isinstance(value, dict):
            fail(key, f"{key} holds {value!r}: a mapping is needed")
        return value

    def path(value, key, kind="folder") -> str:
        """A folder (or file) under the results folder that is there, as written (no trailing /)."""
        if not isinstance(value, str) or not value.strip():
            fail(key, f"{value!r} is not a path: a {kind} relative to the results folder is needed")
        rel = PurePosixPath(value)
        if rel.is_absolute() or ".." in rel.parts:
            fail(key, f"{value} is not a path inside the results folder")
        found = root / rel
        if not (found.is_dir() if kind == "folder" else found.is_file()):
            fail(key, f"no {kind} {rel} under {repo_relative(root)}")
        return str(rel)

    def shaped(value, shape, key):
        if not isinstance(value, list):
            fail(key, f"{value!r}: {shape} is needed")
        if shape == COLUMNS:
            out = []
            for i, column in enumerate(value):
                at = f"{key}[{i}]"
                if not isinstance(column, dict) or not {"folder", "batch"} <= set(column):
                    fail(at, f"{column!r}: a column is {{folder: ..., batch: ...}} (quiet: true optional)")
                if bad := sorted(set(column) - set(COLUMN_KEYS)):
                    fail(at, f"unknown key {bad[0]!r}; valid: {', '.join(COLUMN_KEYS)}")
                if not isinstance(column["batch"], int) or isinstance(column["batch"], bool) or column["batch"] < 1:
                    fail(at, f"batch {column['batch']!r} is not a batch size (a whole number from 1)")
                if not isinstance(column.get("quiet", False), bool):
                    fail(at, f"quiet {column['quiet']!r} is not true or false")
                out.append({**column, "folder": path(column["folder"], at)})
            if len({(c["folder"], c["batch"]) for c in out}) < len(out):
                fail(key, "a column named twice")
            return out
        out = [path(v, f"{key}[{i}]", "file" if shape == FILES else "folder") for i, v in enumerate(value)]
        if len(set(out)) < len(out):
            fail(key, f"{next(v for v in out if out.count(v) > 1)} named twice")
        return out

    data = mapping(data, "the file")
    if bad := sorted(set(data) - set(TOP)):
        fail(bad[0], f"unknown key; valid: {', '.join(TOP)}")
    claims = {}
    for key, value in mapping(data.get("claims") or {}, "claims").items():
        if key not in CLAIMS:
            fail(f"claims.{key}", f"no such claim; valid: {', '.join(CLAIMS)}")
        claims[key] = path(value, f"claims.{key}")
    shapes, report = report_shapes(), {}
    for section, value in mapping(data.get("report") or {}, "report").items():
        if section not in shapes:
            fail(f"report.{section}", f"no such section; valid: {', '.join(shapes)}")
        shape = shapes[section]
        if isinstance(shape, dict):
            report[section] = {}
            for part, v in mapping(value or {}, f"report.{section}").items():
                if part not in shape:
                    fail(f"report.{section}.{part}", f"no such part; valid: {', '.join(shape)}")
                report[section][part] = shaped(v, shape[part], f"report.{section}.{part}")
        else:
            report[section] = shaped(value, shape, f"report.{section}")
    readme = shaped(data.get("readme") or [], FILES, "readme")
    runs = {path(k, f"runs.{k}"): v for k, v in mapping(data.get("runs") or {}, "runs").items()}
    archived = {path(k, f"archived.{k}"): v for k, v in mapping(data.get("archived") or {}, "archived").items()}
    manifest = Manifest(root, claims, report, tuple(readme), runs, archived)

    cites = cited(manifest)
    files = [p for _, section, part in _parts(manifest) for p in manifest.paths(section, part) if p.is_file()]
    for folder, by in cites.items():
        if folder not in runs:
            fail(by, f"{folder} has no entry in runs (the command that made it)")
    for folder, command in runs.items():
        if folder not in cites:
            fail(f"runs.{folder}", "cited by no claim or section: cite it, or move it to archived with a reason")
        why = _command_problem(root, folder, command, files)
        if why:
            fail(f"runs.{folder}", why)
    for folder, reason in archived.items():
        if folder in cites:
            fail(f"archived.{folder}", f"cited by {cites[folder]}: a folder is either cited or archived")
        if not isinstance(reason, str) or not reason.strip():
            fail(f"archived.{folder}", "no reason given (one line: what superseded it, or why no table cites it)")
    for i, file in enumerate(readme):
        if str(PurePosixPath(file).parent) not in cites:
            fail(f"readme[{i}]", f"{file} lies in no folder a claim or section cites")
    return manifest


def cited(manifest: Manifest) -> dict:
    """{folder: the first key citing it} over the claims and the report's sections (a file's folder)."""
    out = {folder: f"claims.{key}" for key, folder in manifest.claims.items()}
    for key, section, part in _parts(manifest):
        for p in manifest.paths(section, part):
            rel = p.relative_to(manifest.root)
            out.setdefault(str(rel.parent) if p.is_file() else str(rel), key)
    return out


def _parts(manifest: Manifest):
    """(key, section, part) of every entry of the report (part None for a section of one value)."""
    for section, value in manifest.report.items():
        for part in value if isinstance(value, dict) else [None]:
            yield f"report.{section}" + (f".{part}" if part else ""), section, part


def _command_problem(root: Path, folder: str, command, files: list[Path]) -> str | None:
    """Why `command` does not say where `folder`'s command is (None: it does)."""
    from repro.reproduction.report.format import command as recorded

    if not isinstance(command, str) or not command.strip():
        return f"{command!r} is not a command: give command.txt, README.md, {RUN_JSON} or the command itself"
    here = root / folder
    if command == COMMAND_TXT:
        return None if (here / COMMAND_TXT).is_file() else f"{folder} has no command.txt"
    if command == README:
        if (here / COMMAND_TXT).is_file():
            return f"{folder} has a command.txt, which the report shows: say command.txt"
        return None if not recorded(here, root).startswith("not recorded") else \
            f"no README.md gives {folder}'s command (its own, or a line of a parent's naming it)"
    if command == RUN_JSON:
        runs = [f for f in files if f.parent == here]
        missing = [f.name for f in runs if not f.with_suffix(".json").is_file()]
        if not runs or missing:
            return f"{RUN_JSON}, but no JSON beside {', '.join(missing) or 'a cited run file of ' + folder}"
    return None
