"""Generated protocol code for gearshift.v1 (see proto/gearshift/v1/*.proto; regenerate with `make proto`)."""
