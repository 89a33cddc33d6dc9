module kvredis.example/score

go 1.19
