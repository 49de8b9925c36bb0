"""The GPU runs: each reproduce_gpu run's steps (status.json), its environment (env/env.json) and
its kernel tests (env/kernel_tests.xml)."""

from repro.reproduction.manifest import ManifestError
from repro.reproduction.report.format import md_table, num
from repro.reproduction.report.schema import read_json


def _kernel_tests(xml_path) -> str:
    """passed / failed / skipped counts of a JUnit XML, and the names of the failed tests."""
    import xml.etree.ElementTree as ET
    try:
        tree = ET.parse(xml_path).getroot()
    except ET.ParseError as err:
        return f"unreadable ({err})"
    suites = [tree] if tree.tag == "testsuite" else tree.findall("testsuite")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname', '')}.{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return (f"{passed} passed, {count['failures'] + count['errors']} failed, {count['skipped']} skipped"
            + (f" (failed: {', '.join(failed)})" if failed else ""))


def _flat(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items() if v is not None)
    if isinstance(value, list):
        return " / ".join(map(str, value))
    return str(value)


def gpu_runs(ctx) -> str:
    """The GPU runs the manifest names (report.gpu_runs: a reproduce_gpu run's folder): their steps
    (status.json of each step's folder), the environment report and the kernel tests."""
    root = ctx.root
    from repro.reproduction.reproduce_gpu import STEPS
    out = ["## GPU runs: environment and steps (`python -m repro.reproduce_gpu`)"]
    by_run = {run: [d for d in sorted(run.iterdir()) if d.name in STEPS.values() and (d / "status.json").is_file()]
              for run in ctx.manifest.paths("gpu_runs")}
    for i, (run, steps) in enumerate(by_run.items()):
        if not steps:
            raise ManifestError(f"report.gpu_runs[{i}]: {run.relative_to(root)} holds no step of "
                                "python -m repro.reproduce_gpu (a <step>/status.json)")
    if not any(by_run.values()):
        return "\n\n".join(out + ["Not run yet (no GPU run in results/claims.yaml): every GPU column above says "
                                  "\"not measured yet\"."])
    for run, steps in by_run.items():
        part = [f"### {run.relative_to(root) if run != root else run.name}"]  # the device's folder
        order = {name: i for i, name in STEPS.items()}
        rows = []
        for d in sorted(steps, key=lambda d: order[d.name]):
            status = read_json(d / "status.json", root)
            jobs = "; ".join(f"{name}: {j.get('status')}" + (f" ({j['reason']})" if j.get("reason") else "")
                             + (f", {num(float(j['seconds']))} s" if j.get("seconds") is not None else "")
                             for name, j in status.get("jobs", {}).items())
            files = ", ".join(sorted(p.name for p in d.iterdir() if p.is_file() and p.suffix in (".csv", ".png",
                                                                                                     ".json", ".xml")
                                     and p.name != "status.json"))
            rows.append([f"{order[d.name]} {d.name}", status.get("status"), jobs, files])
        part.append(md_table(["step", "status", "jobs", "files"], rows))
        env = run / "env"
        if (env / "env.json").is_file():
            facts = read_json(env / "env.json", root)
            part.append("Environment (env/env.json):\n\n"
                        + md_table(["key", "value"], [[k, _flat(v)] for k, v in facts.items()]))
        if (env / "kernel_tests.xml").is_file():
            part.append(f"GPU kernel tests (env/kernel_tests.xml): {_kernel_tests(env / 'kernel_tests.xml')}")
        elif env.is_dir():
            part.append("GPU kernel tests: no env/kernel_tests.xml (not run; see step 1's jobs)")
        out.append("\n\n".join(part))
    return "\n\n".join(out)


SECTIONS = [(100, "gpu_runs", gpu_runs)]
