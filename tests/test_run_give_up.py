"""When `ferrus run` gives up on a stopped agent the task is still in flight, and a second
`ferrus run --task` is refused: the last line says where the task stays and that
`ferrus run --resume` goes on once the cause is fixed."""

import stat
import sys

import ferrus
from conftest import custom_agent_config, run_cli, set_config

NOT_LOGGED_IN = """#!%s
import sys
sys.stdin.read()
print("Not logged in \\u00b7 Please run /login", flush=True)
sys.exit(1)
"""


def test_giving_up_says_the_task_stays_and_how_to_go_on(project, tmp_path):
    program = tmp_path / "agent"
    program.write_text(NOT_LOGGED_IN % sys.executable)
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    set_config(project, custom_agent_config("nologin", [str(program), "{role}"]))
    result = run_cli("run", "--task", "a task", cwd=project, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last == ("ferrus run: giving up: the executor is stopped (the reason is above); "
                    "the task stays Executing — once that is fixed, `ferrus run --resume` "
                    "goes on with it (`ferrus reset` drops it)")
    assert ferrus.Store(str(project)).read_state().state == ferrus.S.EXECUTING
