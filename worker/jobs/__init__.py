"""Running a fine-tune recorded in SQL: lifecycle (claim, run, record), progress reporting, engine configs."""
