"""Tables, the report page, figures and the memory model's table (estimate), from a results folder:
pandas, matplotlib, Jinja2. Never Ray or DeepSpeed."""
