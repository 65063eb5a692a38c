defmodule EMLXAxon.Options do
  @moduledoc false
  # Option schemas: every public entry point declares its options once, as
  # a schema, and that schema validates them (before anything reaches the
  # NIF, where a bad type would only be a badarg), holds their defaults and
  # writes their documentation into the function's @doc. So what a function
  # documents, accepts and defaults to cannot drift apart.
  #
  # A schema is a keyword list of `{key, spec}`, where spec is a keyword
  # list with:
  #
  #   * `:type` - what the option accepts (see `check/2` for the types)
  #   * `:default` - its value when not given (default `nil`)
  #   * `:doc` - what it does, for the generated documentation
  #   * `:default_doc` - the default as documented, when `inspect/1` of
  #     `:default` would not say it (such as a default computed later)
  #   * `:required` - `true` when the option must be given
  #
  # The generation options shared by several entry points are defined here
  # once; each entry point adds its own, or overrides a shared option's
  # `:doc` or `:default` with `put/3`.

  @samplers [:greedy, :top_p_cpu, :top_p_gpu]

  @doc false
  def samplers, do: @samplers

  @kv_dtypes [:float32, :bfloat16, :float16]

  @typedoc "A KV cache's dtype."
  @type kv_dtype :: :float32 | :bfloat16 | :float16

  @doc false
  def kv_dtypes, do: @kv_dtypes

  ## Shared options

  @generation [
    max_new_tokens: [
      type: :pos_integer,
      default: 100,
      doc: "the most tokens to generate per prompt; reaching it gives `finish_reason: :length`"
    ],
    max_len: [
      type: :pos_integer,
      default: 2048,
      doc:
        "the KV cache budget per prompt: prompt plus generated tokens; reaching it gives " <>
          "`finish_reason: :max_len`, and a prompt that leaves no room fails with an " <>
          "`EMLXAxon.Error` of kind `:prompt_too_long`"
    ],
    sampler: [
      type: {:in, @samplers},
      default: :greedy,
      doc:
        "greedy decoding, or nucleus sampling on the host (`:top_p_cpu`) or the device " <>
          "(`:top_p_gpu`); on a CPU both run inside the step"
    ],
    temperature: [
      type: {:custom, {__MODULE__, :temperature}, "a number >= 0"},
      default: 1.0,
      doc: "sampling temperature; 0 decodes greedily, as in mlx-lm"
    ],
    top_p: [
      type: {:custom, {__MODULE__, :top_p}, "a number greater than 0 and at most 1"},
      default: 0.9,
      doc: "nucleus probability mass"
    ],
    top_k: [
      type: :non_neg_integer,
      default: 0,
      doc: "keep only the k most likely tokens; 0 disables it"
    ],
    min_p: [
      type: {:custom, {__MODULE__, :min_p}, "a number from 0 up to, but excluding, 1"},
      default: 0.0,
      doc: "drop tokens less likely than `min_p` times the most likely one; 0 disables it"
    ],
    seed: [
      type: {:or, [nil, :non_neg_integer]},
      default: nil,
      doc: "seed for the sampler's random numbers; `nil` seeds randomly"
    ],
    stop: [
      type:
        {:custom, {__MODULE__, :stop},
         "a non-empty string of valid UTF-8 or a list of them (nil: none)"},
      default: [],
      doc: "strings ending generation (`finish_reason: :stop`), matched on decoded text"
    ],
    eos_token_ids: [
      type: {:custom, {__MODULE__, :eos_token_ids}, "nil or a list of token ids"},
      default: nil,
      default_doc: "the model's and the tokenizer's",
      doc: "the tokens ending generation (`finish_reason: :eos`)"
    ],
    ignore_eos: [type: :boolean, default: false, doc: "keep generating past EOS tokens"],
    kv_bits: [
      type: {:or, [nil, {:in, [2, 3, 4, 5, 6, 8]}]},
      default: nil,
      doc:
        "keep the KV cache quantized to this many bits once it holds `:quantized_kv_start` " <>
          "positions, as mlx-lm's `kv_bits` (8 bits: about 0.53x of a bfloat16 cache); " <>
          "on a CPU the layer kernels read 8- and 4-bit caches as stored, elsewhere " <>
          "attention runs MLX's quantized products. Not offered by a scheduler's " <>
          "slots: with one, requests asking for it fail"
    ],
    kv_group_size: [
      type: {:in, [32, 64, 128]},
      default: 64,
      doc: "values of a head sharing one scale and bias in a quantized KV cache"
    ],
    quantized_kv_start: [
      type: :non_neg_integer,
      default: 5000,
      doc: "positions the KV cache holds before `:kv_bits` quantizes it (mlx-lm's default)"
    ],
    max_kv_size: [
      type: {:or, [nil, :pos_integer]},
      default: nil,
      doc:
        "a rotating KV cache of at most this many positions, the first 4 always kept, as " <>
          "mlx-lm's `max_kv_size`: memory stays bounded and older tokens are forgotten " <>
          "(raise `:max_len` to generate past it); prompts of one length. Not offered by a " <>
          "scheduler's slots, nor with `:kv_bits`"
    ],
    kv_dtype: [
      type: {:or, [nil, {:in, @kv_dtypes}]},
      default: nil,
      doc:
        "the KV cache's dtype. `nil`: `:float16` under a float32 model on the CPU (the " <>
          "CPU's default dtype), as llama.cpp keeps its cache, since reading the cache " <>
          "bounds a long context's decode step there; the model's dtype elsewhere and for " <>
          "`:kv_bits` or `:max_kv_size`. `:float32` keeps keys and values unrounded. A " <>
          "scheduler's slots have the dtype it was started with (a serving gives its own " <>
          "schedulers this one); not with `:kv_bits`"
    ]
  ]

  # At most one of them; see "Structured output" in EMLXAxon.TextGeneration.
  @constraints [
    json_schema: [
      type: {:custom, {__MODULE__, :json_schema}, "nil, a map or JSON text"},
      doc: "constrain the output to JSON valid against this JSON Schema"
    ],
    regex: [
      type: {:custom, {__MODULE__, :regex}, "nil or a string"},
      doc: "constrain the output to match this regular expression"
    ],
    grammar: [
      type: {:custom, {__MODULE__, :grammar}, "nil or a string"},
      doc: "constrain the output to this Lark grammar (as llguidance reads it)"
    ]
  ]

  @doc "The generation and sampling options every generating entry point takes."
  def generation, do: @generation

  @doc """
  The queue bound of a scheduler (`EMLXAxon.Scheduler.start_link/1`) and of
  a serving (`EMLXAxon.TextGeneration.serving/3`): past it a request is
  refused at once with an `:overloaded` error rather than left waiting.
  """
  def max_queue(doc) do
    [type: :non_neg_integer, default: 64, doc: doc]
  end

  @doc "A KV cache dtype as the NIF takes it (`nil`: the engine's default)."
  def native_kv_dtype(nil), do: nil
  def native_kv_dtype(dtype) when dtype in @kv_dtypes, do: Atom.to_string(dtype)

  @doc false
  # A KV dtype as the engine reports it (a binary), or as Elixir names it.
  @spec kv_dtype_of(String.t() | kv_dtype() | nil) :: kv_dtype() | nil
  def kv_dtype_of(dtype) when dtype in @kv_dtypes, do: dtype

  def kv_dtype_of(name) when is_binary(name),
    do: Enum.find(@kv_dtypes, &(Atom.to_string(&1) == name))

  def kv_dtype_of(_), do: nil

  @doc "The constrained decoding options (at most one of them is given)."
  def constraints, do: @constraints

  @doc false
  def constraint_keys, do: Keyword.keys(@constraints)

  @doc """
  `schema` with `key`'s spec updated by `overrides` (such as another
  `:default` or `:doc` for one entry point).
  """
  @spec put(keyword(), atom(), keyword()) :: keyword()
  def put(schema, key, overrides) do
    Keyword.update!(schema, key, &Keyword.merge(&1, overrides))
  end

  @doc "The options' defaults, as a keyword list."
  @spec defaults(keyword()) :: keyword()
  def defaults(schema), do: Enum.map(schema, fn {key, spec} -> {key, spec[:default]} end)

  ## Validation

  @doc """
  Validates the keyword list `opts` against `schema` and returns a map of
  every option in it: the given ones checked (and normalized, such as a
  single `:stop` string into a list), the others their defaults. Raises
  `ArgumentError` naming the option and what it accepts; `where` names
  the function.
  """
  @spec validate!(term(), keyword(), String.t()) :: map()
  def validate!(opts, schema, where) do
    unless Keyword.keyword?(opts) do
      raise ArgumentError,
            "expected #{where} options to be a keyword list, got: #{inspect(opts)}"
    end

    validated =
      Enum.reduce(opts, Map.new(defaults(schema)), fn {key, value}, acc ->
        case Keyword.fetch(schema, key) do
          {:ok, spec} ->
            Map.put(acc, key, check!(key, value, spec[:type], where))

          :error ->
            raise ArgumentError,
                  "unknown option #{inspect(key)} for #{where}, valid options are: " <>
                    Enum.map_join(Keyword.keys(schema), ", ", &inspect/1)
        end
      end)

    for {key, spec} <- schema, spec[:required], not Keyword.has_key?(opts, key) do
      raise ArgumentError,
            "missing the required option #{inspect(key)} (#{describe(spec[:type])}) for #{where}"
    end

    validated
  end

  defp check!(key, value, type, where) do
    case check(type, value) do
      {:ok, value} ->
        value

      # A message of its own, shared with the checks of input maps.
      {:error, {:message, message}} ->
        raise ArgumentError, message

      {:error, detail} ->
        raise ArgumentError,
              "expected #{inspect(key)} to be #{describe(type)}, got: #{inspect(value)}" <>
                if(detail, do: " (#{detail})", else: "") <> " in #{where}"
    end
  end

  @doc """
  Checks `value` against `type`: `{:ok, normalized}` or `{:error, detail}`
  (`detail` is `nil` or what exactly is wrong). Types:

    * `nil`, `:boolean`, `:string` (valid UTF-8), `:map` (not a struct),
      `:pos_integer`, `:non_neg_integer`, `:keyword_list`, `:any`
    * `{:in, values}` - one of `values`
    * `{:struct, module, description}` - a `module` struct
    * `{:fun, arity}` - a function of that arity
    * `{:or, types}` - any of `types`, the first that accepts it
    * `{:custom, {module, fun}, description}` - `module.fun(value)` returns
      `{:ok, normalized}`, `:error`, `{:error, detail}` or
      `{:error, {:message, message}}` (the whole error message)
  """
  @spec check(term(), term()) ::
          {:ok, term()} | {:error, nil | String.t() | {:message, String.t()}}
  def check(nil, nil), do: {:ok, nil}
  def check(:boolean, value) when is_boolean(value), do: {:ok, value}
  def check(:pos_integer, value) when is_integer(value) and value > 0, do: {:ok, value}
  def check(:non_neg_integer, value) when is_integer(value) and value >= 0, do: {:ok, value}
  def check(:map, value) when is_map(value) and not is_struct(value), do: {:ok, value}
  def check(:any, value), do: {:ok, value}

  def check(:string, value) when is_binary(value) do
    if String.valid?(value), do: {:ok, value}, else: {:error, "not valid UTF-8"}
  end

  def check(:keyword_list, value) when is_list(value) do
    if Keyword.keyword?(value), do: {:ok, value}, else: {:error, nil}
  end

  def check({:in, values}, value) do
    if value in values, do: {:ok, value}, else: {:error, nil}
  end

  def check({:struct, module, _description}, %module{} = value), do: {:ok, value}
  def check({:fun, arity}, value) when is_function(value, arity), do: {:ok, value}

  def check({:or, types}, value) do
    Enum.reduce_while(types, {:error, nil}, fn type, error ->
      case check(type, value) do
        {:ok, _} = ok -> {:halt, ok}
        # A more precise reason wins over none.
        {:error, nil} -> {:cont, error}
        {:error, _detail} = detailed -> {:cont, detailed}
      end
    end)
  end

  def check({:custom, {module, fun}, _description}, value) do
    case apply(module, fun, [value]) do
      {:ok, _} = ok -> ok
      :error -> {:error, nil}
      {:error, _detail} = error -> error
    end
  end

  def check(_type, _value), do: {:error, nil}

  @doc "What `type` accepts, in words (for errors and documentation)."
  @spec describe(term()) :: String.t()
  def describe(nil), do: "nil"
  def describe(:boolean), do: "a boolean"
  def describe(:string), do: "a string"
  def describe(:map), do: "a map"
  def describe(:pos_integer), do: "a positive integer"
  def describe(:non_neg_integer), do: "a non-negative integer"
  def describe(:keyword_list), do: "a keyword list"
  def describe(:any), do: "any term"
  def describe({:in, [value]}), do: inspect(value)
  def describe({:in, values}), do: "one of " <> Enum.map_join(values, ", ", &inspect/1)
  def describe({:struct, _module, description}), do: description
  def describe({:fun, 1}), do: "a function of one argument"
  def describe({:fun, arity}), do: "a function of #{arity} arguments"
  def describe({:custom, _fun, description}), do: description

  def describe({:or, types}) do
    {first, [last]} = Enum.split(Enum.map(types, &describe/1), -1)
    if first == [], do: last, else: Enum.join(first, ", ") <> " or " <> last
  end

  ## Documentation

  @doc """
  The Markdown list documenting `schema`'s options: each one's `:doc`,
  what it accepts and its default, so the documentation says exactly what
  `validate!/3` checks.
  """
  @spec docs(keyword()) :: String.t()
  def docs(schema) do
    Enum.map_join(schema, "\n", fn {key, spec} ->
      default =
        cond do
          spec[:required] -> "required"
          text = spec[:default_doc] -> "default: " <> text
          true -> "default: `#{inspect(spec[:default])}`"
        end

      text = "`#{inspect(key)}` - #{spec[:doc]} (#{describe(spec[:type])}; #{default})"
      wrap("  * " <> text, "    ")
    end)
  end

  # Wraps `text` at 78 columns, continuing with `indent`.
  defp wrap(text, indent) do
    text
    |> String.split(" ")
    |> Enum.reduce([], fn
      word, [] ->
        [word]

      word, [line | lines] ->
        if String.length(line) + 1 + String.length(word) > 78,
          do: [indent <> word, line | lines],
          else: [line <> " " <> word | lines]
    end)
    |> Enum.reverse()
    |> Enum.join("\n")
  end

  ## Custom types of the shared options

  @doc false
  def temperature(value) when is_number(value) and value >= 0, do: {:ok, value / 1}
  def temperature(_value), do: :error

  @doc false
  def top_p(value) when is_number(value) and value > 0 and value <= 1, do: {:ok, value / 1}
  def top_p(_value), do: :error

  @doc false
  def min_p(value) when is_number(value) and value >= 0 and value < 1, do: {:ok, value / 1}
  def min_p(_value), do: :error

  @doc false
  def stop(nil), do: {:ok, []}
  def stop(value) when is_binary(value), do: stop([value])

  def stop(value) when is_list(value) do
    if Enum.all?(value, &(is_binary(&1) and &1 != "" and String.valid?(&1))),
      do: {:ok, value},
      else: :error
  end

  def stop(_value), do: :error

  @doc false
  def eos_token_ids(nil), do: {:ok, nil}
  def eos_token_ids(value) when is_integer(value), do: eos_token_ids([value])

  def eos_token_ids(value) when is_list(value) do
    if Enum.all?(value, &(is_integer(&1) and &1 >= 0)), do: {:ok, value}, else: :error
  end

  def eos_token_ids(_value), do: :error

  @doc false
  # A timeout in milliseconds; nil means none.
  def timeout(value) when value in [nil, :infinity], do: {:ok, :infinity}
  def timeout(value) when is_integer(value) and value >= 0, do: {:ok, value}
  def timeout(_value), do: :error

  @doc false
  def tools(nil), do: {:ok, nil}

  def tools(tools) when is_list(tools) do
    tools
    |> Enum.with_index()
    |> Enum.find_value({:ok, tools}, fn {tool, index} ->
      case EMLXAxon.ToolCalls.check_tool(tool) do
        :ok -> nil
        {:error, reason} -> {:error, "tool #{index}: #{reason}"}
      end
    end)
  end

  def tools(_other), do: :error

  @doc false
  # The `:tools` option, as the chat template and the grammar take it.
  def tools_spec(doc) do
    [
      type:
        {:custom, {__MODULE__, :tools},
         "nil or a list of tools, each a map such as `%{type: \"function\", function: " <>
           "%{name: \"get_weather\", description: \"...\", parameters: json_schema}}` " <>
           "(or the inner function map)"},
      default: nil,
      doc: doc
    ]
  end

  ## Constraints

  @doc false
  def json_schema(value) when is_map(value) and not is_struct(value), do: {:ok, value}
  def json_schema(value) when is_boolean(value), do: {:ok, value}
  def json_schema(value), do: constraint_text(:json_schema, value)

  @doc false
  def regex(value), do: constraint_text(:regex, value)

  @doc false
  def grammar(value), do: constraint_text(:grammar, value)

  defp constraint_text(_key, nil), do: {:ok, nil}

  defp constraint_text(key, value) do
    case constraint!(%{key => value}, "the options") do
      {^key, _text} -> {:ok, value}
    end
  rescue
    error in ArgumentError -> {:error, {:message, error.message}}
  end

  @doc """
  The constraint `opts` (a map or keyword list with any of `:json_schema`,
  `:regex` and `:grammar`) asks for: `nil` or `{kind, text}`, a JSON
  Schema given as a map encoded to JSON. Raises `ArgumentError` when more
  than one is given or a value has the wrong type; the engine checks the
  schema, regex or grammar itself before generating.
  """
  @spec constraint!(map() | keyword(), String.t()) :: nil | {atom(), String.t()}
  def constraint!(opts, where) do
    given = for key <- constraint_keys(), (value = opts[key]) != nil, do: {key, value}

    case given do
      [] ->
        nil

      [{:json_schema, schema}] when is_map(schema) or is_boolean(schema) ->
        {:json_schema, EMLXAxon.JSON.encode!(schema)}

      [{key, text}] when is_binary(text) ->
        if String.valid?(text) do
          {key, text}
        else
          raise ArgumentError, "expected #{inspect(key)} in #{where} to be valid UTF-8"
        end

      [{:json_schema, other}] ->
        raise ArgumentError,
              "expected :json_schema in #{where} to be a map or a JSON string, " <>
                "got: #{inspect(other)}"

      [{key, other}] ->
        raise ArgumentError,
              "expected #{inspect(key)} in #{where} to be a string, got: #{inspect(other)}"

      [_, _ | _] ->
        raise ArgumentError,
              ":json_schema, :regex and :grammar are mutually exclusive, but #{where} " <>
                "gives #{Enum.map_join(given, " and ", &inspect(elem(&1, 0)))}"
    end
  end

  @doc """
  Checks that `stop` strings come with a tokenizer (the engine matches them
  on decoded text).
  """
  @spec check_stop_needs_tokenizer!(map(), term(), String.t()) :: :ok
  def check_stop_needs_tokenizer!(%{stop: [_ | _]}, nil, where) do
    raise ArgumentError,
          ":stop strings are matched on decoded text, so #{where} needs a tokenizer " <>
            "(the :tokenizer option) to use them"
  end

  def check_stop_needs_tokenizer!(_opts, _tokenizer, _where), do: :ok

  ## To the engine

  @doc """
  The map of generation options the NIF's `generation_start/5` expects (all
  keys present). `:row_seeds` (one seed or `nil` per prompt, giving each
  row its own random numbers) is taken from `opts` when there, and so is
  `:row_constraints` (one `nil` or `{kind, text}` per prompt).
  """
  @spec native(map()) :: map()
  def native(opts) do
    %{
      max_new_tokens: opts.max_new_tokens,
      max_len: opts.max_len,
      sampler: opts.sampler,
      temperature: opts.temperature,
      top_p: opts.top_p,
      top_k: opts.top_k,
      min_p: opts.min_p,
      seed: opts.seed,
      stop: opts.stop,
      eos_token_ids: opts.eos_token_ids,
      ignore_eos: opts.ignore_eos,
      profile_timing: opts.profile_timing,
      kv_bits: opts.kv_bits,
      kv_group_size: opts.kv_group_size,
      quantized_kv_start: opts.quantized_kv_start,
      max_kv_size: opts.max_kv_size,
      kv_dtype: native_kv_dtype(opts.kv_dtype),
      row_seeds: Map.get(opts, :row_seeds)
    }
    |> put_constraints(Map.get(opts, :row_constraints))
  end

  # One `nil` or `{kind, text}` per prompt, or `nil` when no row has one.
  defp put_constraints(native, nil), do: native

  defp put_constraints(native, constraints),
    do: Map.put(native, :row_constraints, constraints)
end
