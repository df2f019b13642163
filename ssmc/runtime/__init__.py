"""Runtime support shared by backends: argument binding."""
