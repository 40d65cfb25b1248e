"""The run config: its schema (every key typed, with defaults and rules), its loading and its error words."""
