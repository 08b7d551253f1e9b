"""Run configuration: every setting declared once, the config built from the declarations, validation.

Configs are code (``ml_collections.ConfigDict`` returned by ``get_config()`` of a
``configs/*.py`` file) and any field can be overridden from the command line,
e.g. ``--config.rl.steps=50`` or ``--config.objective.kwargs.eps_high=0.28``.

Every field of every section is declared once, with its default, its one-line
meaning and its check, by a settings dataclass (:func:`jaxrl_llm.settings.setting`);
:class:`Settings` says which dataclass declares which section. From there:

* :func:`base_config` returns the defaults as a *locked* ConfigDict (assigning a
  field that does not exist raises, so a typo in a config file or a sweep fails
  before anything runs); ``task.kwargs`` and ``objective.kwargs`` stay open;
* :func:`validate` runs the declared checks and the cross-field ones; each error
  names the field, the value and what was expected; all are reported together;
* :func:`settings` gives the typed settings of a config
  (``settings(config).control`` is a ``ControlSettings``);
* ``objective.recipe`` / ``objective.kwargs`` are resolved by
  :func:`jaxrl_llm.learner.builders.recipe_call` (the recipe's own defaults, plus
  the run-provided values of ``builders.RUN_VALUES``), which validation uses too;
* ``python -m jaxrl_llm.configuration.reference --write`` regenerates
  ``docs/config.md``, the reference of every field, recipe and task.

Modules: ``training`` and ``operations`` (the settings dataclasses of the
sections without one elsewhere), ``schema`` (the table, ``base_config``,
``settings``, ``override``), ``validation``, ``reference`` (docs/config.md).
"""

from jaxrl_llm.configuration.schema import (ConfigError, Settings, base_config, get_field, override, run_dir,
                                            settings)
from jaxrl_llm.configuration.validation import validate

__all__ = ["ConfigError", "Settings", "base_config", "get_field", "override", "run_dir", "settings", "validate"]
