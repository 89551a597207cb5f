"""The limits on input (README, "Reliability and security"): whatever a recipe or a command line
says, loading and planning take bounded work and memory. A light module (no torch): the CLI's
privacy commands check against it too."""

#: a recipe file is read no further than this
MAX_RECIPE_BYTES = 1_000_000
#: keys and values of a recipe once its aliases are expanded (a nine-level alias bomb would expand a
#: few hundred bytes into 10^9 values); its characters are capped at MAX_RECIPE_BYTES as well
MAX_VALUES = 100_000
#: nested mappings and lists (PyYAML's composer recurses: 5,000 brackets raised RecursionError)
MAX_DEPTH = 32
#: recipes in one chain of `extends:`
MAX_EXTENDS = 16
#: the most steps a run may plan (plans are computed in closed form; the limit keeps every count,
#: and the time it states, meaningful)
MAX_STEPS = 10**9
