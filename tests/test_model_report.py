"""Setting a role's model (`/model`, `ferrus register --executor-model`) says which model
was written, not only the agent — `/model executor foo` used to answer with the agent alone."""

import ferrus


def test_the_report_names_the_model_set_or_cleared(project):
    said = []
    ferrus.update_hq_config(str(project), "executor", "codex", "gpt-big ", said.append)
    ferrus.update_hq_config(str(project), "executor", "codex", "", said.append)
    ferrus.update_hq_config(str(project), "supervisor", "codex", None, said.append)
    assert said == [
        'Set [hq.executor] agent = "codex", model = "gpt-big" in ferrus.toml',
        'Set [hq.executor] agent = "codex", model = "" (the agent\'s own default) in ferrus.toml',
        'Set [hq.supervisor] agent = "codex" in ferrus.toml']
    assert ferrus.load_config(str(project)).require_hq().executor.model == ""
