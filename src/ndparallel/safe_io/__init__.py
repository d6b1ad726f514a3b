"""Reading and writing files that cannot be turned against the user: writes that never follow links and a
manifest of what ndparallel wrote (``owned_files``), names kept inside their directory (``file_names``),
YAML and regular expressions read with bounds (``bounded_yaml``, ``bounded_regex``), and hub ids fetched into
the Hugging Face cache, once per node (``hub``).

Layer: just above ``errors``; imports nothing else of ndparallel. Everything that reads or writes files uses it.
"""
