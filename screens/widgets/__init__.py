"""The dashboard's panels, one module each: hosts, service, stepper, current job, event log, banner."""
