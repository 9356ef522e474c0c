"""Layout control: resizing the pools and the ratio controller that decides when."""
