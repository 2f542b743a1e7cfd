"""deploy/: the Zero to JupyterHub values, the volumes, the grading Jobs and the image, checked as far
as a machine without a cluster or a Docker engine allows (docs/INSTRUCTORS.md, "A class on JupyterHub").

- every file parses; the Helm values, merged over the chart's defaults as Helm merges them, validate
  against the chart's own values schema when ``Z2JH_CHART`` names the chart's folder (``jupyterhub/``
  of the chart's repository, with ``values.yaml`` and ``values.schema.yaml``);
- what the hub's extraConfig computes agrees with the course's code (``autograder.hub.pod_uid``),
  and the Jobs run as the instructor's pod uid with a ``course grade`` it accepts;
- the image's build steps (deploy/image/build.sh) run outside Docker: ``make test-image``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from autograder import hub

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "z2jh" / name).read_text()) if d]


def _values() -> dict:
    return _docs("values.yaml")[0]


def test_every_deploy_file_parses():
    files = sorted((DEPLOY / "z2jh").glob("*.yaml"))
    assert [f.name for f in files] == ["grade-job.yaml", "record-job.yaml", "values.yaml", "volumes.yaml"]
    for path in files:
        assert _docs(path.name), path
    assert [d["kind"] for d in _docs("volumes.yaml")] == ["PersistentVolumeClaim", "PersistentVolumeClaim"]


def _merged(defaults, ours):
    """Helm's merge of a values file over the chart's defaults: maps merge, anything else is replaced."""
    if isinstance(defaults, dict) and isinstance(ours, dict):
        return {k: _merged(defaults.get(k), ours[k]) if k in ours else defaults[k] for k in {*defaults, *ours}}
    return ours


def test_the_values_validate_against_the_charts_schema():
    """As ``helm install`` validates them: merged over the chart's defaults, against its values schema."""
    chart = os.environ.get("Z2JH_CHART")
    if not chart:
        pytest.skip("Z2JH_CHART does not name the chart's folder (jupyterhub/, with values.schema.yaml)")
    import jsonschema

    schema = yaml.safe_load((Path(chart) / "values.schema.yaml").read_text())
    defaults = yaml.safe_load((Path(chart) / "values.yaml").read_text())
    jsonschema.validate(_merged(defaults, _values()), schema)
    broken = _merged(defaults, {**_values(), "singleuser": {**_values()["singleuser"], "cmdd": ["x"]}})
    with pytest.raises(jsonschema.ValidationError):  # the schema does refuse what the chart does not know
        jsonschema.validate(broken, schema)


def _extra_config() -> SimpleNamespace:
    """Run the hub's extraConfig as the hub would, on a stand-in ``c``."""
    c = SimpleNamespace(KubeSpawner=SimpleNamespace())
    exec(_values()["hub"]["extraConfig"]["10-course"], {"c": c})  # noqa: S102 - our own config
    return c


def _spawner(name: str) -> SimpleNamespace:
    return SimpleNamespace(
        user=SimpleNamespace(name=name), volumes=[], volume_mounts=[], environment={}, notebook_dir="", args=[], cmd=[]
    )


def test_each_pod_runs_as_the_uid_the_course_computes_for_its_login():
    c = _extra_config()
    for login in ("teach", "ada", "bob", "a-much-longer-login.name"):
        assert c.KubeSpawner.uid(_spawner(login)) == hub.pod_uid(login)


def test_instructors_get_the_course_volume_and_formgrader_and_learners_the_learners_configuration():
    c = _extra_config()
    admins = set(_values()["hub"]["config"]["Authenticator"]["admin_users"])
    for login in admins:
        spawner = _spawner(login)
        c.KubeSpawner.pre_spawn_hook(spawner)
        assert spawner.args == ["--cd=/srv/course/workbook"] and spawner.environment["COURSE_POD_ACCOUNTS"]
        assert "/srv/course/workbook/.venv/bin/python" in spawner.cmd[2]  # the course's own venv grades
        assert [v["persistentVolumeClaim"]["claimName"] for v in spawner.volumes] == ["class-course"]
    learner = _spawner("ada")
    c.KubeSpawner.pre_spawn_hook(learner)
    assert learner.args == [] and not learner.volumes
    assert learner.environment["JUPYTER_CONFIG_PATH"].endswith("/opt/resilient-course/course/kit/jupyter/learner")
    assert (REPO / "course" / "kit" / "jupyter" / "learner").is_dir()


def test_the_grading_jobs_run_as_the_instructors_pod_uid_with_a_course_grade_it_accepts():
    (teach,) = _values()["hub"]["config"]["Authenticator"]["admin_users"]
    shards, record = _docs("grade-job.yaml")[0], _docs("record-job.yaml")[0]
    spec = shards["spec"]
    container = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == int(env["SHARDS"])
    for job in (shards, record):
        assert job["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == hub.pod_uid(teach)
    grade = container["args"][0]
    assert grade.startswith("exec /srv/course/workbook/.venv/bin/course grade")  # the course directory's venv
    for flag in ("--shard", "--cache", "--no-record"):
        assert flag in grade
    helped = subprocess.run(
        [sys.executable, "-m", "course.kit.cli", "grade", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--shard", "--cache", "--no-record"):
        assert flag in helped, f"course grade has no {flag}"


def test_the_instructors_pod_names_the_rosters_uids_and_says_when_two_collide(tmp_path, monkeypatch):
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0::/root:/bin/bash\njovyan:x:1000:100::/home/jovyan:/bin/bash\n")
    monkeypatch.setattr(hub, "roster", lambda course: ["ada", "bob"])
    said = hub.pod_accounts(tmp_path, passwd)
    lines = passwd.read_text().splitlines()
    assert f"ada:x:{hub.pod_uid('ada')}:100::/home/jovyan:/usr/sbin/nologin" in lines
    assert f"bob:x:{hub.pod_uid('bob')}:100::/home/jovyan:/usr/sbin/nologin" in lines
    assert said == [f"2 learner(s) of the roster named in {passwd} (pod uids)"]
    assert hub.pod_accounts(tmp_path, passwd) == []  # again: nothing to add
    monkeypatch.setattr(hub, "pod_uid", lambda login: 30000)
    monkeypatch.setattr(hub, "roster", lambda course: ["cyd", "dee"])
    said = hub.pod_accounts(tmp_path, passwd)
    assert said[0] == "dee and cyd share the pod uid 30000: collect cannot tell them apart"


def test_the_image_runs_the_build_script_from_the_hand_out_and_starts_the_accounts_server():
    dockerfile = (DEPLOY / "image" / "Dockerfile").read_text()
    assert "RUN bash /opt/resilient-course/deploy/image/build.sh /opt/resilient-course" in dockerfile
    assert 'CMD ["python", "-m", "autograder.hub", "singleuser"]' in dockerfile
    assert _values()["singleuser"]["cmd"][1:] == ["-m", "autograder.hub", "singleuser"]
