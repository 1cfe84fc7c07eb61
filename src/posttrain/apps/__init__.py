"""Products built on posttrain: ``ci_fix`` (the CI auto-fix agent) and ``docs`` (the document pipeline).

Nothing below this package imports it.
"""
