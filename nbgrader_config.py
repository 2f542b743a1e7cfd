# nbgrader reads this file from the working directory; the configuration lives in autograder/.
load_subconfig("autograder/nbgrader_config.py")  # noqa: F821
