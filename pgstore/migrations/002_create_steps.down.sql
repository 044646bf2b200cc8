DROP TABLE IF EXISTS idem_records_steps;
