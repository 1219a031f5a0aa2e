"""Reading a job file: `load_job(path, overrides)` reads YAML, applies `key.sub=value` overrides and
validates against the schema in ascendfactory/spec.py. Every problem of the file is collected into one
JobError (dotted path, YAML line, did-you-mean). `json_schema()` is that schema for editors.
"""

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ascendfactory.errors import JobError, Problem, did_you_mean
from ascendfactory.spec import JobSpec, show_value


def _line_index(text: str) -> dict[tuple, int]:
    """Map each key path in the YAML text to its 1-based line number."""
    try:
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return {}
    out: dict[tuple, int] = {}

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value
                out[path + (key,)] = k.start_mark.line + 1
                walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                out[path + (i,)] = v.start_mark.line + 1
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return out


def _block_fields(loc: tuple) -> list[str]:
    """Field names valid at the parent of `loc` (for did-you-mean on an unknown key)."""
    model: Any = JobSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        ann = field.annotation
        for candidate in (ann, *getattr(ann, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
                break
        else:
            return []
    return list(model.model_fields) if hasattr(model, "model_fields") else []


def _problems_from(err: ValidationError, lines: dict[tuple, int], overridden: set[tuple]) -> list[Problem]:
    problems = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        # a key with a newline or control character would break the one-line location: show its repr
        where = ".".join(p if isinstance(p, str) and len(p) <= 60 and p.isprintable() else show_value(p) for p in loc)
        line = None if loc in overridden else lines.get(loc)
        if line is None and loc not in overridden:
            for i in range(len(loc) - 1, 0, -1):
                if loc[:i] in lines:
                    line = lines[loc[:i]]
                    break
        origin = " (from a command-line override)" if loc in overridden else ""
        hint = None
        if e["type"] == "int_out_of_range":
            ctx = e["ctx"]
            msg, hint = e["msg"] + origin, ctx["hint"]
        elif e["type"] == "extra_forbidden":
            msg = f"unknown key {show_value(loc[-1])}{origin}"
            options = _block_fields(loc)
            guess = did_you_mean(loc[-1], options)
            hint = f"did you mean '{guess}'?" if guess else (
                "allowed here: " + ", ".join(options) if options else None)
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] == "literal_error":
            expected = e.get("ctx", {}).get("expected", "")
            got = e.get("input")
            msg = f"{show_value(got)} is not allowed{origin}; expected {expected}"
            choices = [c.strip(" '") for c in str(expected).replace(" or ", ",").split(",")]
            guess = did_you_mean(got, choices)
            hint = f"did you mean '{guess}'?" if guess else None
        else:
            msg = e["msg"].removeprefix("Value error, ") + origin
            if e["type"] not in ("value_error", "assertion_error") and "input" in e and not isinstance(e["input"], dict):
                msg += f" (got {show_value(e['input'])})"
        problems.append(Problem(where or "(job)", msg, line=line, hint=hint))
    return sorted(problems, key=lambda p: (p.line is None, p.line or 0))


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise JobError("Bad override", [Problem(item, "overrides look like key.sub=value",
                                                hint="e.g. train.lr=2e-5 parallel.tp=2")])
    key, _, raw = item.partition("=")
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise JobError("Bad override", [Problem(item, "empty key")])
    try:
        _yaml_guard(raw)
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, OverflowError):
        value = raw
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> set[tuple]:
    touched = set()
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
        touched.add(tuple(path))
    return touched


def read_job_text(path: str | Path) -> str:
    p = Path(path)
    if not p.exists():
        raise JobError(f"Job file not found: {p}", [Problem("(file)", f"{p} does not exist",
                                                            hint="check the path, or create one with `ascendfactory init`")])
    if p.is_dir():
        raise JobError(f"Not a job file: {p}", [Problem("(file)", f"{p} is a directory; pass the YAML file")])
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"Cannot read job file {p}", [Problem("(file)", str(exc))]) from None


# A job file is a few kB of YAML. These bounds stop what would exhaust memory or the stack before
# anything is built: aliases that expand to billions of nodes ("billion laughs"), nesting deeper
# than the recursive composer survives, megabytes of text.
MAX_JOB_CHARS = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 100_000   # after expanding every alias


def _yaml_guard(text: str) -> None:
    """Walk the event stream (iterative, builds nothing) and refuse a document too big or deep."""
    if len(text) > MAX_JOB_CHARS:
        raise JobError("The job file is too large", [Problem(
            "(file)", f"{len(text)} characters; a job file is at most {MAX_JOB_CHARS}",
            hint="keep data in data files; a job file names them")])
    anchors: dict[str, int] = {}
    sizes: list[list] = []  # open collections: [anchor, expanded size so far]
    total = 0

    def refuse(what: str, event, hint: str) -> None:
        raise JobError("The job file's YAML is refused", [Problem(
            "(yaml)", what, line=event.start_mark.line + 1 if event.start_mark else None, hint=hint)])

    for event in yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            sizes.append([event.anchor, 1])
            total += 1
            if len(sizes) > MAX_YAML_DEPTH:
                refuse(f"nested more than {MAX_YAML_DEPTH} levels deep", event, "flatten the structure")
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, size = sizes.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
            total += 1
        elif isinstance(event, yaml.AliasEvent):
            anchor, size = None, anchors.get(event.anchor, 1)
            total += size
        else:
            continue
        if anchor is not None:
            anchors[anchor] = size
        if sizes:
            sizes[-1][1] += size
        if total > MAX_YAML_NODES:
            refuse(f"expands to more than {MAX_YAML_NODES} values (anchors and aliases count once per use)",
                   event, "write the job without deeply repeated aliases")


def _load_yaml(text: str, source: str) -> Any:
    from ascendfactory.catalog import load_yaml_unique

    try:
        _yaml_guard(text)
        return load_yaml_unique(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        what = getattr(exc, "problem", None) or str(exc)
        raise JobError(f"{source} is not valid YAML", [Problem("(yaml)", str(what), line=line,
                                                               hint="fix the YAML syntax at that line")]) from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of more digits than Python reads
        raise JobError(f"{source} holds a value that cannot be read", [Problem(
            "(yaml)", str(exc), hint="look for a number thousands of digits long")]) from None


def parse_job(text: str, overrides: list[str] | None = None, source: str = "job") -> JobSpec:
    data = _load_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise JobError(f"{source} must be a YAML mapping of keys (model:, framework:, data:, …)",
                       [Problem("(job)", f"the file holds a {type(data).__name__}, not a mapping")])
    overridden = apply_overrides(data, overrides or [])
    lines = _line_index(text)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        problems = _problems_from(err, lines, overridden)
        n = len(problems)
        error = JobError(f"{source}: {n} problem{'s' if n != 1 else ''} in the job file", problems)
        error.partial, error.removed = _without_refused(data, err)
        raise error from None


def _without_refused(data: dict, err: ValidationError) -> tuple[JobSpec | None, list[str]]:
    """The job with every refused key dropped (its default instead), when that is a valid job: the later
    checks (matrix, layout, inputs) then see the rest of the file. None when a required key is wrong."""
    data, removed = copy.deepcopy(data), []
    for e in err.errors():
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        node, path = data, []
        for part in loc:   # as deep as the data goes (union members and validators add parts of their own)
            if not isinstance(node, dict) or part not in node or not isinstance(part, str):
                break
            parent, node = node, node[part]
            path.append(part)
        if not path or e["type"] == "missing":
            return None, []
        parent.pop(path[-1], None)
        removed.append(".".join(path))
    try:
        return JobSpec.model_validate(data), removed
    except ValidationError:
        return None, []


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    return parse_job(read_job_text(path), overrides, source=str(path))


def json_schema() -> dict:
    schema = JobSpec.model_json_schema()
    schema["title"] = "AscendFactory job"
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
